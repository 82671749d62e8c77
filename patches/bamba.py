"""Bamba: positions numbered from 0 in every forward that is given none.

With no `position_ids`, `BambaModel` numbers the input's tokens 0..T-1 whatever the cache holds (a
second turn over a cache restarts its RoPE positions at 0 on one process; other families add the
cache's length). hf-contextpar hands the model explicit global positions (past + arange), so on a
second turn Bamba would rotate its attention by other positions than one process does (3.0 off in
fp64). This patch gives such a forward Bamba's own positions before the context-parallel hook reads
the inputs.
"""

from __future__ import annotations

import torch


def _positions_from_zero(module, args, kwargs):
    if kwargs.get("position_ids") is not None:
        return None
    x = kwargs.get("input_ids", args[0] if args else None)
    if x is None:
        x = kwargs.get("inputs_embeds")
    if x is None:
        return None  # the input contract refuses it with its own message
    kwargs["position_ids"] = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
    return args, kwargs


def apply(model):
    """Give every forward Bamba's positions explicitly; returns undo()."""
    handle = model.register_forward_pre_hook(_positions_from_zero, with_kwargs=True)
    return handle.remove
