"""Targeted tests for feature combinations that once gave wrong answers or crashed (issue 10):
each case runs on N ranks against the unpatched model in the same process (tests/workers/holes_worker.py)."""

import pytest
from holes_worker import cases
from launch import matrix

PARAMS = [(n, name) for n in (2, 3) for name, _ in cases(n)]


@pytest.mark.parametrize("n,case", PARAMS, ids=[f"N{n}-{c}" for n, c in PARAMS])
def test_case(n, case, tmp_path_factory):
    records = matrix("holes_worker.py", n, tmp_path_factory)
    for rank, recs in enumerate(records):
        rec = next(r for r in recs if r["case"] == case)
        assert rec["ok"], f"rank {rank}: {rec}"
