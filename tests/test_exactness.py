"""The exactness matrix: every supported family x N = 1..4 processes x case, on CPU/gloo, against
the unpatched single-process model. One launch per N runs every family (see cp_worker.py); each
case is its own test, so a failure reads like `test_exact[N3-llama-beam_search]`."""

from __future__ import annotations

import pytest
from cp_worker import FAMILIES
from launch import matrix, tolerance


def _logits_within_tolerance(r, n, family):
    assert r["max_diff"] <= tolerance(family, r["dtype"])


def _tokens_identical(r, n, family):
    assert r["tokens_equal"] and r["ranks_agree"]


def _greedy(r, n, family):
    _tokens_identical(r, n, family)
    assert r["cache_tokens"] <= r["cache_bound"]  # each rank holds ~1/N of the KV cache


def _padded_batch(r, n, family):
    if r.get("reference_nan"):  # HF's fp64 eager Gemma2 softmax runs in fp32 and NaNs on padding
        assert r["finite"] or n == 1  # N = 1 runs the stock model
        return
    _logits_within_tolerance(r, n, family)
    _tokens_identical(r, n, family)


def _batched_decode(r, n, family):
    """Every sequence's shards stay level; batched pass-Q decode ran exactly where B >= N > 1."""
    _tokens_identical(r, n, family)
    assert r["spread"] <= 1 and (r["pass_q_steps"] >= 8) == (r["batch"] >= n > 1)


def _hidden_states(r, n, family):
    assert r["count_equal"]
    _logits_within_tolerance(r, n, family)


def _removed(r, n, family):
    assert r["bitwise"]  # remove_context_parallel restores stock behaviour bit for bit


def _bf16(r, n, family):
    assert r["max_diff"] <= max(r["kernel_swap"], 1e-2)  # what swapping the attention kernel alone changes


CASES = {
    "prefill_logits": _logits_within_tolerance,
    "greedy": _greedy,
    "padded_batch": _padded_batch,
    "batched_decode": _batched_decode,
    "beam_search": _tokens_identical,
    "hidden_states": _hidden_states,
    "greedy_embeds": _tokens_identical,
    "sampling": _tokens_identical,
    "removed": _removed,
    "bf16_prefill": _bf16,
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n", [1, 2, 3, 4], ids=lambda n: f"N{n}")
def test_exact(n, family, case, tmp_path_factory):
    for rank, records in enumerate(matrix("cp_worker.py", n, tmp_path_factory)):
        mine = [r for r in records if r["family"] == family]
        errors = [r["error"] for r in mine if r["case"] == "error"]
        assert not errors, f"rank {rank}: {errors[0]}"
        runs = [r for r in mine if r["case"] == case]
        assert runs, f"rank {rank}: no {case} record for {family}"
        for r in runs:
            try:
                CASES[case](r, n, family)
            except AssertionError as e:
                raise AssertionError(f"rank {rank} {r}") from e
