"""The exactness matrix: every supported family, N = 1..4 processes on CPU/gloo, against the
unpatched single-process model. One launch per N runs every family (see cp_worker.py)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from cp_worker import FAMILIES  # noqa: E402
from launch import matrix, tolerance  # noqa: E402

def results(n: int, tmp_path_factory) -> list[list[dict]]:
    return matrix("cp_worker.py", n, tmp_path_factory)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_family_exact(n, family, tmp_path_factory):
    for rank, records in enumerate(results(n, tmp_path_factory)):
        mine = [r for r in records if r["family"] == family]
        errors = [r["error"] for r in mine if r["case"] == "error"]
        assert not errors, f"rank {rank}: {errors[0]}"
        cases = {r["case"] for r in mine}
        assert {"prefill_logits", "greedy", "padded_batch", "sampling", "removed", "bf16_prefill",
                "beam_search", "hidden_states", "greedy_embeds"} <= cases
        assert any(r["case"] == "batched_decode" for r in mine)
        for r in mine:
            where = f"rank {rank} {r}"
            if r["case"] in ("prefill_logits", "hidden_states") or (r["case"] == "padded_batch" and "max_diff" in r):
                tol = tolerance(family, r["dtype"])
                assert r["max_diff"] <= tol, where
            if r["case"] == "hidden_states":
                assert r["count_equal"], where
            if r["case"] == "batched_decode":  # every sequence's shards stay level; pass-Q decode ran where B >= N
                assert r["spread"] <= 1 and (r["pass_q_steps"] >= 8) == (r["batch"] >= n > 1), where
            if r["case"] in ("greedy", "greedy_embeds", "padded_batch", "sampling", "beam_search", "batched_decode") \
                    and "tokens_equal" in r:
                assert r["tokens_equal"] and r["ranks_agree"], where
            if r["case"] == "padded_batch" and r.get("reference_nan") and n > 1:  # N = 1 runs the stock model
                assert r["finite"], where
            if r["case"] == "greedy":
                assert r["cache_tokens"] <= r["cache_bound"], where
            if r["case"] == "removed":
                assert r["bitwise"], where
            if r["case"] == "bf16_prefill":
                assert r["max_diff"] <= max(r["kernel_swap"], 1e-2), where
