"""The exactness matrix: every supported family x N = 2..4 processes x case, on CPU/gloo, against
the unpatched single-process model. One launch per N runs the families whose tests were selected
(see cp_worker.py; at N = 3 and 4 the day's rotation picks half of them each, tests/conftest.py); each case is its own test, so a failure reads like
`test_exact[N3-llama-beam_search]`. Tolerances are the exactness oracle's (hf_contextpar.eval.oracle).

N = 1 is not in the matrix: on one process apply_context_parallel validates the model and returns
it untouched, so a comparison with the stock model cannot fail; `test_world_size_one_changes_nothing`
checks exactly that instead."""

from __future__ import annotations

import pytest
import torch
from cp_worker import FAMILIES, impl_for
from hf_contextpar.patches import REGISTRY
from launch import matrix, selected, tolerance

import hf_contextpar
from hf_contextpar.models import tiny_model

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


def _hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())


def test_world_size_one_changes_nothing(monkeypatch):
    """On one process apply_context_parallel validates the model (a bad strategy or an unsupported model
    is refused as on N) and returns the same object unchanged: no hooks, no runtime, the stock forward
    and attention implementation, and bitwise the stock logits and tokens."""
    for var in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError):
        hf_contextpar.apply_context_parallel(tiny_model("llama"), strategy="bogus")
    with pytest.raises(hf_contextpar.UnsupportedModelError):
        hf_contextpar.apply_context_parallel(tiny_model("mistral", sliding_window=1))
    ids = torch.randint(0, 256, (2, 37), generator=torch.Generator().manual_seed(0))
    for family in FAMILIES:
        model, stock = (tiny_model(family, dtype=torch.float64, attn_implementation=impl_for(family)) for _ in "ab")
        before = (model.config.to_dict(), model.config._attn_implementation, _hooks(model), dict(vars(model)))
        assert hf_contextpar.apply_context_parallel(model) is model, family
        after = (model.config.to_dict(), model.config._attn_implementation, _hooks(model), dict(vars(model)))
        assert after == before, family
        assert hf_contextpar.get_runtime(model) is None and "forward" not in vars(model), family
        with torch.no_grad():
            assert torch.equal(model(ids).logits, stock(ids).logits), family
            kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
            assert torch.equal(model.generate(ids, **kw), stock.generate(ids, **kw)), family
        assert hf_contextpar.remove_context_parallel(model) is model
