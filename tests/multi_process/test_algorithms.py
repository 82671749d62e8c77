"""Every attention algorithm as a specification (issue 12), in ring-flash-attention's shape.

This file holds the checks that launch ranks (tests/launch.py); the others, and the feature's whole description, are in
tests/unit/test_algorithms.py.
"""

from __future__ import annotations

from launch import worker_path

from hf_contextpar.tools.selftest.spec import (
    CASES,
)


def test_simulator_matches_the_real_comm(tmp_path):
    """Every case's plans on 3 gloo processes with the real Comm (tests/workers/algorithms_worker.py): (out, LSE)
    bit-identical to the simulated ranks', and the same bytes and calls per operation."""
    from launch import run_matrix

    for rank, records in enumerate(run_matrix(3, worker_path("algorithms_worker.py"), tmp_path)):
        errors = [r for r in records if r["case"] == "error"]
        assert not errors, f"rank {rank}: {errors}"
        assert {r["case"] for r in records} == {c.name for c in CASES}
        for r in records:
            assert r["identical"] and r["real"] == r["sim"], f"rank {rank}: {r}"
