"""DeepSeek-V4 (docs/design.md, "Compressed attention"): exact under context parallelism at N = 2, 3
(tests/workers/v4_worker.py), what moves queries refused, and the design checked on one process (dev/v4_chain_check.py):
contiguous spans continuing from the compressors' unfinished groups the span before left, every span's compressors handed the whole layer's entries, are the one
forward to fp64 rounding once the model's fp32 internals run in fp64; a 1-token span is not (HCA's decode path).

This file holds the checks that launch ranks (tests/launch.py); the others, and the feature's whole description, are in
tests/unit/test_deepseek_v4.py.
"""

from __future__ import annotations

import pytest
from launch import matrix


@pytest.mark.parametrize("n", [2, 3])
def test_exact_under_context_parallelism(n, tmp_path_factory):
    """fp64 (internals too) logits within 1e-10 of one process: a padded prompt, a second turn, a turn every rank
    runs; identical greedy tokens on every rank; each rank keeps every N-th compressed entry."""
    records = [r for rank in matrix("v4_worker.py", n, tmp_path_factory) for r in rank]
    errors = [r["error"] for r in records if r["case"] == "error"]
    assert not errors, errors[0]
    assert {r["case"] for r in records} == {"prefill", "second_turn", "short_turn", "entries", "greedy", "short_prompt"}
    for r in records:
        if "max_diff" in r:
            assert r["max_diff"] < 1e-10, r
        elif r["case"] == "entries":
            assert r["kept"] == r["share"] and r["made"] > n, r
        else:
            assert r["tokens_equal"] and r["ranks_agree"], r
