"""OPT: learned absolute positions that the model reads off the attention mask.

With no `position_ids`, `OPTDecoder` (and its `OPTLearnedPositionalEmbedding`) numbers each row's
tokens by `cumsum(attention_mask) * attention_mask - 1`: a left-padded row's first real token is at
position 0, its pads at -1. hf-contextpar hands the model explicit global positions (past + arange),
which is what every RoPE family computes, but on a padded batch OPT would then embed other positions
than one process does (0.6 off in fp64 on the census's padded batch). This patch computes OPT's own
positions from the whole (global) mask before the context-parallel hook reads the inputs, so each
rank's share carries the positions one process uses.
"""

from __future__ import annotations

import torch


def _positions_from_mask(module, args, kwargs):
    """OPT's positions for the new tokens, where the caller gave a mask and no positions."""
    mask = kwargs.get("attention_mask")
    if kwargs.get("position_ids") is not None or mask is None or mask.dim() != 2:
        return None  # given positions are the caller's; a 4D mask is refused by the input contract
    x = kwargs.get("input_ids", args[0] if args else None)
    if x is None:
        x = kwargs.get("inputs_embeds")
    if x is None or x.shape[1] > mask.shape[1]:
        return None  # a mismatched mask: the input contract refuses it with its own message
    positions = (torch.cumsum(mask, dim=1) * mask - 1).long()
    kwargs["position_ids"] = positions[:, mask.shape[1] - x.shape[1] :]
    return args, kwargs


def apply(model):
    """Give every forward OPT's mask-derived positions explicitly; returns undo()."""
    handle = model.register_forward_pre_hook(_positions_from_mask, with_kwargs=True)
    return handle.remove
