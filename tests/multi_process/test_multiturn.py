"""Multi-turn context parallelism: partial prefill over a persistent sharded cache (Meta 3.5.2-3.5.3)."""

from __future__ import annotations

import pytest
from launch import matrix
from multiturn_worker import FAMILIES
from records import tolerance


def results(n: int, tmp_path_factory) -> list[list[dict]]:
    return matrix("multiturn_worker.py", n, tmp_path_factory)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_multiturn_exact_and_balanced(n, family, tmp_path_factory):
    for rank, records in enumerate(results(n, tmp_path_factory)):
        mine = [r for r in records if r["family"] == family]
        assert len(mine) == 6
        for r in mine:
            assert "error" not in r, f"rank {rank}: {r.get('error')}"
            tol = tolerance(family, r["dtype"])
            assert r["max_diff"] <= tol and r["tokens_equal"] and r["balanced"], f"rank {rank} {r}"
