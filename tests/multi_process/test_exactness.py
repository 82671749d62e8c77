"""The exactness matrix: every supported family x N = 2..4 processes x case, on CPU/gloo, against
the unpatched single-process model. One launch per N runs the families whose tests were selected
(see cp_worker.py; at N = 3 and 4 the day's rotation picks half of them each, tests/conftest.py); each case is its own test, so a failure reads like
`test_exact[N3-llama-beam_search]`. Tolerances are the exactness oracle's (hf_contextpar.eval.oracle).

N = 1 is not in the matrix: on one process apply_context_parallel validates the model and returns
it untouched, so a comparison with the stock model cannot fail; `test_world_size_one_changes_nothing`
checks exactly that instead.

This file holds the checks that launch ranks (tests/launch.py); the in-process ones are in tests/unit/test_exactness.py.
"""

from __future__ import annotations

import pytest
from cp_worker import FAMILIES
from hf_contextpar.patches import REGISTRY
from launch import matrix, selected
from records import tolerance

WORLD_SIZES = [2, 3, 4]


def _logits_within_tolerance(r, n, family):
    assert r["max_diff"] <= tolerance(family, r["dtype"])


def _tokens_identical(r, n, family):
    assert r["tokens_equal"] and r["ranks_agree"]


def _greedy(r, n, family):
    _tokens_identical(r, n, family)
    assert r["cache_tokens"] <= r["cache_bound"]  # each rank holds ~1/N of the KV cache
    assert r["index_tokens"] <= r["cache_bound"]  # and of an indexed-attention model's index keys (0 without)


def _padded_batch(r, n, family):
    if r.get("reference_nan"):  # HF's fp64 eager Gemma2 softmax runs in fp32 and NaNs on padding
        assert r["finite"]
        return
    _logits_within_tolerance(r, n, family)
    _tokens_identical(r, n, family)


def _batched_decode(r, n, family):
    """Every sequence's shards stay even; batched pass-Q decode ran exactly where B >= N."""
    _tokens_identical(r, n, family)
    batched = r["batch"] >= n and not REGISTRY[family].indexed  # indexed attention decodes replicated
    assert r["spread"] <= 1 and (r["pass_q_steps"] >= 8) == batched


def _hidden_states(r, n, family):
    assert r["count_equal"]
    _logits_within_tolerance(r, n, family)


def _removed(r, n, family):
    assert r["bitwise"]  # remove_context_parallel restores stock behaviour bit for bit


def _bf16(r, n, family):
    # the kernel-swap bound: what swapping the attention kernel alone changes on one process
    assert r["max_diff"] <= tolerance(family, r["dtype"], r["kernel_swap"])


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
@pytest.mark.parametrize("n", WORLD_SIZES, ids=lambda n: f"N{n}")
def test_exact(n, family, case, request, tmp_path_factory):
    args = selected(request, "family", FAMILIES)
    for rank, records in enumerate(matrix("cp_worker.py", n, tmp_path_factory, args)):
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
