"""CSPS's CSA (issue 41): the approximate mode's settings on one process, and, on N = 2, 3, 4 ranks
(tests/workers/csa_worker.py), its distributed run against its one-process reference and, keeping every token,
against the unpatched model.

This file holds the checks that launch ranks (tests/launch.py); the others, and the feature's whole description, are in
tests/unit/test_csa.py.
"""

import pytest
from csa_worker import cases
from launch import matrix, selected

PARAMS = [(n, name) for n in (2, 3, 4) for name, _ in cases(n)]


@pytest.mark.parametrize("n,case", PARAMS, ids=[f"N{n}-{c}" for n, c in PARAMS])
def test_csa_matches_its_reference_and_keep_all_is_exact(n, case, tmp_path_factory, request):
    names = [name for name, _ in cases(n)]
    records = matrix("csa_worker.py", n, tmp_path_factory, selected(request, "case", names))
    for rank, recs in enumerate(records):
        rec = next(r for r in recs if r["case"] == case)
        assert rec["ok"], f"rank {rank}: {rec}"
