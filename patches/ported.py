"""Families whose attention transformers keeps hand-written, ported to its AttentionInterface (issue 58).

XGLM, GPT-Neo, ... compute their attention inline (their own matmul, mask and softmax), so transformers refuses to
switch them to another attention implementation (`PreTrainedModel._can_set_attn_implementation`: their modeling file
never calls `ALL_ATTENTION_FUNCTIONS.get_interface(`), and hf-contextpar's attention cannot take over. Each family's
module (xglm.py, gpt_neo.py) gives its attention class a forward written the way transformers ported its other
families: q/k/v as the original computes them, the cache through its `update`, then one call of the attention the
config names, with the family's own scaling and window. This module does what they share, reversibly: the forward
and the attributes an attention function reads put on every attention module (instance attributes over the
class's), and the model told it may switch (an instance attribute over transformers' source-reading heuristic).
"""

from __future__ import annotations

import types

_MISSING = object()


def port(model, class_name: str, forward, attributes) -> callable:
    """Give every `class_name` module of `model` the ported `forward` and `attributes(module) -> dict` (what the
    attention functions read: num_key_value_groups, is_causal, config, layer_idx); returns undo(). A module whose
    forward was replaced on the instance already (a user's patch that calls SDPA itself, a hook) keeps it: replaced
    again, the user's code would be dropped unseen; kept, a forward that bypasses the library's attention is refused
    at the first forward, naming its layer (the coverage check)."""
    modules = [m for m in model.modules() if type(m).__name__ == class_name and "forward" not in m.__dict__]
    saved = []
    for module in modules:
        values = attributes(module)
        saved.append((module, {name: module.__dict__.get(name, _MISSING) for name in values}))
        for name, value in values.items():
            object.__setattr__(module, name, value)  # plain attributes: a config is no submodule
        module.forward = types.MethodType(forward, module)
    undo_switch = _settable(model)

    def undo():
        undo_switch()
        for module, old in saved:
            module.__dict__.pop("forward", None)
            for name, value in old.items():
                module.__dict__.pop(name, None)
                if value is not _MISSING:
                    module.__dict__[name] = value

    return undo


def _settable(model):
    """Let `model.set_attn_implementation` switch this model: its attention modules now call the interface."""
    models = [m for m in model.modules() if hasattr(type(m), "_can_set_attn_implementation")]
    for m in models:
        object.__setattr__(m, "_can_set_attn_implementation", lambda: True)

    def undo():
        for m in models:
            m.__dict__.pop("_can_set_attn_implementation", None)

    return undo


def attention_function(config, default):
    """The attention the config names (hf-contextpar's under context parallelism), or the family's eager one."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, default)


def attend(module, query, key, value, attention_mask, **kwargs):
    """The call a ported forward of an AttentionInterface family makes (Doge's, Inkling's): the attention the config
    names, with the module's scaling and its dropout outside training; kwargs: the family's own (its score bias,
    sliding window, sinks) and the forward's. Returns (output, weights)."""
    attention = attention_function(module.config, None)
    dropout = 0.0 if not module.training else module.attention_dropout
    return attention(module, query, key, value, attention_mask, dropout=dropout, scaling=module.scaling, **kwargs)


def eager(module, query, key, value, attention_mask, scaling=1.0, dropout=0.0, **kwargs):
    """The hand-written attention these families keep (scores, additive mask, softmax, dropout, values), as an
    attention function: what a ported model runs when its config names 'eager'."""
    import torch

    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[..., : key.shape[-2]]
    weights = torch.nn.functional.softmax(scores, dim=-1)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def switched(config) -> bool:
    """Does the config name hf-contextpar's attention (as it does under context parallelism)? A family whose port
    hands it what transformers' own attentions do not take (a score bias from global columns: ALiBi) keeps its own
    forward under those."""
    from hf_contextpar.attention import NAME

    return config._attn_implementation == NAME
