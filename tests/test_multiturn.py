"""Multi-turn context parallelism: partial prefill over a persistent sharded cache (Meta 3.5.2-3.5.3)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from launch import run_matrix  # noqa: E402
from multiturn_worker import FAMILIES  # noqa: E402

_results: dict[int, list] = {}


def results(n: int, tmp_path_factory) -> list[list[dict]]:
    if n not in _results:
        worker = os.path.join(os.path.dirname(__file__), "multiturn_worker.py")
        _results[n] = run_matrix(n, worker, tmp_path_factory.mktemp(f"mt{n}"))
    return _results[n]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_multiturn_exact_and_balanced(n, family, tmp_path_factory):
    for rank, records in enumerate(results(n, tmp_path_factory)):
        mine = [r for r in records if r["family"] == family]
        assert len(mine) == 6
        for r in mine:
            assert "error" not in r, f"rank {rank}: {r.get('error')}"
            tol = 1e-10 if r["dtype"] == "float64" else 1e-4
            assert r["max_diff"] <= tol and r["tokens_equal"] and r["balanced"], f"rank {rank} {r}"
