"""All-gather KV, KV-Runahead and Ulysses prefill (issue: the other prefill families), every strategy's
traffic against the analytical formulas, and KV-Runahead's partition search and table.

This file holds the checks that launch ranks (tests/launch.py); the in-process ones are in tests/unit/test_strategies.py.
"""

from __future__ import annotations

import pytest
from launch import matrix
from records import tolerance
from strategy_worker import FAMILIES, STRATEGIES

from hf_contextpar.plan.partitions import even


def results(n: int, tmp_path_factory) -> list[list[dict]]:
    return matrix("strategy_worker.py", n, tmp_path_factory)


def _no_errors(records, rank):
    errors = [r for r in records if r["case"] == "error"]
    assert not errors, f"rank {rank} {errors[0]['job']}: {errors[0]['error']}"


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_strategy_exact(n, strategy, tmp_path_factory):
    for rank, records in enumerate(results(n, tmp_path_factory)):
        _no_errors(records, rank)
        mine = [r for r in records if r.get("strategy") == strategy and r["case"] != "traffic"]
        for family in FAMILIES:
            cases = {r["case"] for r in mine if r["family"] == family}
            if "unsupported" in cases:  # Ulysses: N must divide the heads; said at apply time
                assert strategy == "ulysses", family
                continue
            assert {"prefill_logits", "padded_generate", "second_turn"} <= cases, (family, cases)
        for r in mine:
            where = f"rank {rank} {r}"
            if "max_diff" in r:
                tol = tolerance(r["family"], r["dtype"])
                assert r["max_diff"] <= tol, where
            if "tokens_equal" in r:
                assert r["tokens_equal"] and r.get("ranks_agree", True), where
            if r["case"] == "second_turn":  # KV-Runahead's chain needs a fresh prompt: the second turn rings
                assert r["algorithm"] == ("ring_pass_kv" if strategy == "kv_runahead" else strategy), where
            if r["case"] == "unsupported":  # heads N does not divide, or one MLA latent for all heads
                assert "does not divide" in r["message"] or "cannot split by head" in r["message"], where


@pytest.mark.parametrize("n", [2, 3, 4])
def test_traffic_matches_the_formulas(n, tmp_path_factory):
    every = results(n, tmp_path_factory)
    for rank, records in enumerate(every):
        _no_errors(records, rank)
        traffic = [r for r in records if r["case"] == "traffic"]
        assert {r["strategy"] for r in traffic} >= {"ring_pass_kv", "ring_pass_q", "allgather_kv", "kv_runahead"}
        for r in traffic:
            assert (r["sent"], r["received"]) == (r["expected_sent"], r["expected_received"]), f"rank {rank} {r}"
    # totals over the ranks, even partitions (64 tokens): the papers' formulas in K/V rows
    for strategy, rows in (("ring_pass_kv", (n - 1) * 64), ("allgather_kv", (n - 1) * 64), ("kv_runahead", None)):
        sent = sum(
            r["sent"]
            for records in every
            for r in records
            if r["case"] == "traffic" and r["strategy"] == strategy and r["length"] == 64
        )
        row_bytes = 2 * 4 * 16 * 4 * 2  # K and V, 4 KV heads, head dim 16, fp32, 2 layers (tiny phi3)
        if strategy == "kv_runahead":  # KVR Eq. 7: (N-1)/2 C for even partitions (exact when N divides C)
            sizes = even(64, n)
            assert sent == sum(sum(sizes[: i + 1]) for i in range(n - 1)) * row_bytes
            if 64 % n == 0:
                assert sent == (n - 1) * 64 // 2 * row_bytes
        else:
            assert sent == rows * row_bytes


@pytest.mark.parametrize("n", [2, 3, 4])
def test_kvr_search_on_a_model(n, tmp_path_factory):
    for rank, records in enumerate(results(n, tmp_path_factory)):
        _no_errors(records, rank)
        (r,) = [r for r in records if r["case"] == "kvr_search"]
        assert r["evaluated"] > 1 and r["seconds"] <= r["even_seconds"] and r["sizes_agree"], r
        assert sum(r["sizes"]) == 384 and min(r["sizes"]) > 0


@pytest.mark.parametrize("n", [2, 3, 4])
def test_forward_with_autograd_on(n, tmp_path_factory):
    for rank, records in enumerate(results(n, tmp_path_factory)):
        _no_errors(records, rank)
        (r,) = [r for r in records if r["case"] == "grad_mode"]
        assert r["max_diff"] <= tolerance("llama", "float32") and r["grad_enabled"], r
