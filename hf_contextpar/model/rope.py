"""Position-dependent RoPE: every rank uses the frequencies of the whole forward.

transformers' `dynamic_rope_update` (dynamic NTK scaling, longrope) picks the rotary frequencies
from the longest position in the forward; a rank sees only its shard (or its sequences), so the
patched forward first updates them from the whole forward's longest position (the plan's
`rope_length`), exactly as one process does, then computes this rank's cos/sin with them.
"""

from __future__ import annotations

import inspect
import types

import torch

from ..attention import current_step
from ..errors import UnsupportedModelError


def patch_rope(model) -> list:
    """Patch every position-dependent rotary embedding of `model`; returns the modules, for `unpatch_rope`."""
    modules = [m for m in model.modules() if _position_dependent(m)]
    for m in modules:
        m.forward = types.MethodType(_global_rope_forward, m)
    return modules


def unpatch_rope(modules) -> None:
    for m in modules:
        del m.forward


def _position_dependent(module) -> bool:
    """A rotary embedding whose frequencies depend on the longest position in the forward."""
    rope_type = getattr(module, "rope_type", None)
    if not isinstance(rope_type, (str, dict)):
        return False
    kinds = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
    if not any("dynamic" in t or t == "longrope" for t in kinds):
        return False
    if inspect.unwrap(type(module).forward) is type(module).forward:
        raise UnsupportedModelError(
            f"{type(module).__name__} uses {sorted(set(kinds))} RoPE without transformers' dynamic_rope_update "
            "decorator, so hf-contextpar cannot give every rank the frequencies of the whole sequence."
        )
    return True


def _global_rope_forward(self, x, position_ids, *args, **kwargs):
    step = current_step.get()
    decorated = type(self).forward
    if step is None:
        return decorated(self, x, position_ids, *args, **kwargs)
    longest = torch.full((1, 1), step.plan.rope_length - 1, dtype=position_ids.dtype, device=position_ids.device)
    decorated(self, x, longest, *args, **kwargs)  # the frequency update, exactly as one process makes it
    return inspect.unwrap(decorated)(self, x, position_ids, *args, **kwargs)
