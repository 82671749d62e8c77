"""This rank's share of a forward's inputs: what the plan's `Shards` say it runs.

The pre-hook (runtime.py) hands the model's forward its keyword arguments; under sequence sharding each rank
keeps its own new tokens (and their positions, and its partition's share of the mask in a chain), under batched
decode its own sequences. The mirror of outputs.py, which puts every rank's rows back together afterwards.
"""

from __future__ import annotations

import functools

import torch

from .plan.forward import ForwardPlan

TOKEN_ARGS = ("input_ids", "inputs_embeds", "position_ids")  # the per-token arguments a rank runs its share of


def shard_inputs(kwargs: dict, plan: ForwardPlan, inputs, rank: int, hooks) -> None:
    """This rank's share of the inputs in `kwargs` (in place): its new tokens (sequence sharding) or its sequences
    (batched decode). inputs: the contract's checked `Inputs`; hooks: the family's (model/families.FamilyHooks), whose
    `chained_mask` cuts a chained rank's share of the mask."""
    kwargs["position_ids"] = inputs.position_ids
    shards = plan.shards
    if shards.token_rows is not None:
        mine = shards.token_rows[rank]
        if plan.chained and inputs.mask is not None:
            # the family's cut of the mask (FamilyHooks.chained_mask), its tokens' columns ending at `end`
            end = inputs.mask.shape[1] - plan.num_new + int(mine[-1]) + 1
            kwargs["attention_mask"] = hooks.chained_mask(inputs.mask, end - len(mine), end)
        for name in TOKEN_ARGS:
            if kwargs.get(name) is not None:
                kwargs[name] = kwargs[name][:, mine.to(kwargs[name].device)]
        if kwargs.get("cache_position") is not None:  # remote-code models still take it
            kwargs["cache_position"] = kwargs["cache_position"][mine.to(kwargs["cache_position"].device)]
        kwargs["logits_to_keep"] = plan.outputs.keep[rank]
    elif shards.seq_rows is not None:
        mine = shards.seq_rows[rank]
        for name in TOKEN_ARGS:
            if kwargs.get(name) is not None:
                kwargs[name] = kwargs[name][mine]
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:  # its sequences' rows: a model may read the mask by its
            kwargs["attention_mask"] = mask[mine]  # own batch size (CTRL views it as (batch, -1)); `mine`: a slice
    keep = kwargs.get("logits_to_keep", 0)
    if isinstance(keep, int):  # the rows an int means, as an index: a model may act on an int itself (Gemma 4
        # drops the other rows before its KV-shared layers, by each rank's own token count)
        x = next(kwargs[k] for k in ("input_ids", "inputs_embeds") if kwargs.get(k) is not None)
        n = x.shape[1]
        kwargs["logits_to_keep"] = _kept_rows(n, keep, x.device) if n <= 8 else torch.arange(n, device=x.device)[-keep:]


@functools.lru_cache(maxsize=64)
def _kept_rows(num: int, keep: int, device) -> torch.Tensor:
    """logits_to_keep=keep as an index into num rows, built once per shape for decode's few tokens (two tensor ops a
    step otherwise); shared read-only, as models only index with it."""
    return torch.arange(num, device=device)[-keep:]
