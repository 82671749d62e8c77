"""Score biases from global columns (hf_contextpar/attention/bias.py): ALiBi (BLOOM, MPT, Falcon's alibi=True) and
Doge's per-key bias from the keys' values.

This file holds the checks that launch ranks (tests/launch.py); the others, and the feature's whole description, are in
tests/unit/test_score_bias.py.
"""

from __future__ import annotations

import pytest
from bias_worker import CASES
from launch import matrix, selected

ALIBI_CASES = [":".join(c) for c in CASES]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("case", ALIBI_CASES)
def test_alibi_exact_at_2k_tokens(request, tmp_path_factory, n, case):
    records = matrix("bias_worker.py", n, tmp_path_factory, selected(request, "case", ALIBI_CASES))
    for rank, recs in enumerate(records):
        mine = [r for r in recs if r["case_name"] == case]
        assert mine and mine[0]["case"] == "exact", (rank, mine)
        assert mine[0]["max_diff"] <= 1e-10 and mine[0]["tokens_equal"], (rank, mine[0])
