"""Hybrid and recurrent models under context parallelism (issue 30): each family of tests/workers/hybrids.py (its
realistic layer mix, recurrent layers beside attention) against the unpatched model on one process, at
N = 2, 3, 4: fp64 logits within 1e-10 (the models' fp32 internals run in fp64) for a padded uneven prompt,
a second turn over the cache, a turn too short to split and a forward without a cache; greedy,
beam-search and sampled tokens identical (greedy in fp32 too), the same on every rank. The strategies
other than auto's KV-Runahead, and KV-Runahead over uneven partitions, run the same checks on two
families at N = 2."""

from __future__ import annotations

import pytest
from hybrids import BEAMS_REFUSED, FAMILIES, STATE_LIST
from launch import matrix, selected

EXACT = 1e-10
CASES = {"prefill", "second_turn", "short_turn", "no_cache", "greedy", "short_prompt", "beams", "sample", "greedy_fp32"}


def _check(records, family):
    mine = [r for r in records if r["family"] == family]
    errors = [r["error"] for r in mine if r["case"] == "error"]
    assert not errors, errors[0]
    assert {r["case"] for r in mine} == CASES
    for r in mine:
        if "refused" in r:  # beam search where one process does not reorder the states (MiniMax)
            assert r["refused"] and family in BEAMS_REFUSED, r
        elif "max_diff" in r:
            assert r["max_diff"] < EXACT, r
        else:
            assert r["tokens_equal"] and r["ranks_agree"], r
        if r["case"] == "no_cache":
            assert r["cache_none"], r
        if "kv_tokens" in r:  # KV per rank = KV / N after each turn, uneven partitions rebalanced
            assert r["kv_tokens"] == r["even"], r


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_hybrid_exact(n, family, request, tmp_path_factory):
    for records in matrix("hybrid_worker.py", n, tmp_path_factory, selected(request, "family", FAMILIES)):
        _check(records, family)


@pytest.mark.parametrize("strategy", ["ring_pass_kv", "ring_pass_q", "allgather_kv", "ulysses", "uneven"])
@pytest.mark.parametrize("family", ["qwen3_next", "falcon_h1"])
def test_hybrid_strategies(strategy, family, tmp_path_factory):
    for records in matrix("hybrid_worker.py", 2, tmp_path_factory, ("qwen3_next,falcon_h1", strategy)):
        _check(records, family)


STATE_CASES = {"prefill", "second_turn", "short_then_step", "pairs", "no_cache", "greedy", "greedy_tokens"}
STATE_CASES |= {"generate_turn", "padding_refused", "batched_step_refused", "beams_refused", "sample", "greedy_fp32"}
STATE_CASES |= {"mismatched_state_refused"}


@pytest.mark.parametrize("family", list(STATE_LIST))
@pytest.mark.parametrize("n,strategy", [(2, "auto"), (3, "auto"), (4, "auto"), (3, "ring_pass_kv")])
def test_state_list_exact(n, strategy, family, tmp_path_factory):
    """RWKV (its states a list of its own, `state=`; patches/rwkv.py) against one process: exact, or refused where one
    process is not each sequence's own (tests/workers/hybrid_worker.py `check_state_list`)."""
    for records in matrix("hybrid_worker.py", n, tmp_path_factory, (",".join(STATE_LIST), strategy)):
        mine = [r for r in records if r["family"] == family]
        errors = [r["error"] for r in mine if r["case"] == "error"]
        assert not errors, errors[0]
        assert {r["case"] for r in mine} == STATE_CASES
        for r in mine:
            if "refused" in r:
                assert r["refused"], r
            elif "max_diff" in r:
                assert r["max_diff"] < EXACT, r
            else:
                assert r["tokens_equal"] and r["ranks_agree"], r
            assert r.get("in_place", True) and r.get("cache_none", True), r
