"""Every attention algorithm as a specification (issue 12), in ring-flash-attention's shape.

The specification lives in `hf_contextpar.tools.selftest.spec` (one copy, shared with `python -m
hf_contextpar selftest --simulated`): whole-sequence Q, K, V are cut the way a plan says, the
plan's algorithm runs unmodified on N simulated ranks (`hf_contextpar.tools.selftest.simulated`, one thread per
rank), and every rank's (out, LSE) must equal plain whole-sequence attention and its traffic the
analytical bytes. This file runs it as a CPU matrix.

A test id reads `<case>-N<ranks>-T<length>-<heads>-<mask>-<dtype>`. T is the number of new
tokens of a prefill, or the prompt length before the decode steps of a decode case. Seeded random
sequences of forwards cover the combinations the matrix does not list. Issue 13's single-GPU
check runs the same specification on CUDA in bf16/fp16/fp32 (`selftest --simulated`, run by
tests/multi_process/test_cuda.py where a GPU is present). The last tests break an algorithm or its messages on
purpose and check that this file notices.

This file holds the checks that launch ranks (tests/launch.py); the in-process ones are in tests/unit/test_algorithms.py.
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
