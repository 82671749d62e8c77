"""Llama 4 (text): attention temperature tuning on its NoPE layers, at global positions.

Llama 4 scales the queries of its layers without RoPE by log1p(floor((p + 1) / floor_scale)) *
attn_scale + 1, where `Llama4TextAttention.forward` takes p as `arange(local length) + cached
length`: the positions of a contiguous query block. A context-parallel rank holds other
columns (head-tail shards, a decode token of some sequences), so this patch switches the module's
own scaling off and applies the same arithmetic to the query projection's output at the columns
the rank's rows really hold (`Step.q_cols`): bit for bit what one process computes, since nothing
runs between that projection and the scaling on a NoPE layer (no RoPE, no QK-norm there).
"""

from __future__ import annotations

import torch


def _scaled_queries(module):
    from hf_contextpar.attention import current_step

    def hook(proj, args, out):
        cols = current_step.get().q_cols.to(out.device)
        scales = torch.log1p(torch.floor((cols.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0
        q = out.view(*out.shape[:-1], -1, module.head_dim)
        return (q * scales.view(1, -1, 1, 1)).to(out.dtype).view(out.shape)

    return hook


def apply(model):
    """Move every NoPE layer's temperature tuning onto its query projection; returns undo()."""
    undo = []
    for module in model.modules():
        if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
            handle = module.q_proj.register_forward_hook(_scaled_queries(module))
            module.attn_temperature_tuning = False
            undo.append((module, handle))

    def restore():
        for module, handle in undo:
            handle.remove()
            module.attn_temperature_tuning = True

    return restore
