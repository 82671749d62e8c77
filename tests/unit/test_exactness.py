"""The exactness matrix: every supported family x N = 2..4 processes x case, on CPU/gloo, against
the unpatched single-process model. One launch per N runs the families whose tests were selected
(see cp_worker.py; at N = 3 and 4 the day's rotation picks half of them each, tests/conftest.py); each case is its own test, so a failure reads like
`test_exact[N3-llama-beam_search]`. Tolerances are the exactness oracle's (hf_contextpar.eval.oracle).

This file holds the checks that run in the pytest process; the others, and the feature's whole description, are in
tests/multi_process/test_exactness.py.
"""

from __future__ import annotations

import pytest
import torch
from cp_worker import FAMILIES, impl_for

import hf_contextpar
from hf_contextpar.models import tiny_model


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
