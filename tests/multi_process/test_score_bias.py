"""Score biases from global columns (hf_contextpar/attention/bias.py): ALiBi (BLOOM, MPT, Falcon's alibi=True) and
Doge's per-key bias from the keys' values.

The kernels' bias on its own (one process): attending key blocks apart and merging their partials by LSE is the
whole attention under the explicit bias, with padding, a window, batched decode's per-sequence columns, Ulysses' head
slice. Then the families against the unpatched model on one process at 2,048 tokens, where the bias dominates
(tests/workers/bias_worker.py: each prefill strategy, KV-Runahead, pass-Q and all-gather included, a left-padded batch,
both decode modes, a second turn), fp64 with the models' fp32 softmax kept in fp64: 1e-10; Doge with its A drawn
from N(0, 1), where its census model's zeros make the bias a constant softmax ignores.

This file holds the checks that launch ranks (tests/launch.py); the in-process ones are in tests/unit/test_score_bias.py.
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
