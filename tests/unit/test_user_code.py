"""What users do around a patched model (issue 42), exact or refused with a typed error on every rank:
custom attention functions, attention forwards patched to call SDPA themselves, caches copied and continued,
training mode, model.forward and the inner decoder, PEFT's LoRA, compile order, re-registered families and
dropped models. The multi-process cases run in one launch per N (tests/workers/user_code_worker.py).

This file holds the checks that run in the pytest process; the ones that launch ranks are in tests/multi_process/test_user_code.py.
"""

from __future__ import annotations

import pytest
import torch

import hf_contextpar
from hf_contextpar import patches
from hf_contextpar.models import tiny_model


def test_reregistering_a_verified_family_is_refused():
    """register() of a family the library lists (OPT, whose left-padding patch an entry of the user's would
    drop) is refused, and the library's entry stays; a new family registers, and re-registers, as before."""
    before = patches.REGISTRY["opt"]
    with pytest.raises(hf_contextpar.RegistrationError, match="already in hf-contextpar's registry"):
        patches.register(patches.FamilyPatch("opt", "an older README's opt-in"))
    assert patches.REGISTRY["opt"] is before and before.apply is not None
    try:
        for what in ("mine", "mine again"):
            assert (
                patches.register(patches.FamilyPatch("not_a_family_yet", what)) is patches.REGISTRY["not_a_family_yet"]
            )
    finally:
        patches.REGISTRY.pop("not_a_family_yet", None)


def test_wrappers_are_refused_with_the_module_to_apply_to():
    """torch.compile's and PEFT's wrappers are refused at apply (one process too), naming what to do."""
    model = tiny_model("llama")
    with pytest.raises(hf_contextpar.UnsupportedModelError, match=r"torch\.compile\(hf_contextpar\.apply_context"):
        hf_contextpar.apply_context_parallel(torch.compile(model))
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(hf_contextpar.UnsupportedModelError, match=r"get_base_model\(\)"):
        hf_contextpar.apply_context_parallel(peft_model)
    assert hf_contextpar.apply_context_parallel(peft_model.get_base_model()) is peft_model.get_base_model()
