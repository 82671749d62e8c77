"""Inkling 2 (text): its relative-position bias and per-token sinks held with the queries, its attention residuals
over depth kept local.

`Inkling2SlidingAttention` and `Inkling2FullAttention` add to head h's score of query q and key k the bias
R[q, h, q - k] for 0 <= q - k < rel_extent (0 beyond), R = norm(linear(hidden)) @ proj from the query token's hidden
state (`Inkling2RelativePositionBias`; the norm log-scales by the query's position on full layers), and put one more
logit per query and head in the softmax, `sink_proj` of the query's hidden state, with no value. The model numbers
the distances from its cache's offsets (`get_relative_distance`), which under context parallelism are neither a
rank's queries' positions nor its keys'. Under hf-contextpar's attention the patched forward computes R for this
rank's queries and hands it as a score bias read at each block's global columns (patches/inkling.py `RelativeBias`),
and the sinks as per-query sink logits (`s_aux` of shape (B, H, Tq), merged once after every block, as GPT-OSS's per
head): both stay with the queries, so strategies that move queries are refused. `Inkling2BlockAttentionResidual`
attends each token over its own earlier layers' outputs through the attention interface: it runs the family's eager
attention, on every rank for its own tokens, as one process does. Its short convolutions chain (registered as
chained); under transformers' own attention the model's forwards run unchanged.
"""

from __future__ import annotations

import sys

from hf_contextpar.attention import current_step

from . import ported
from .inkling import RelativeBias


def _forward(
    self,
    hidden_states,
    key_hidden_states=None,
    value_hidden_states=None,
    attention_mask=None,
    relative_distance=None,
    conv_mask=None,
    cache=None,
    cache_offset=0,
    **kwargs,
):
    """transformers' Inkling2SlidingAttention / Inkling2FullAttention.forward (5.x), with the relative bias and the
    sinks of this rank's queries (hf-contextpar's attention only)."""
    kwargs.pop("past_key_values", None)
    given = dict(attention_mask=attention_mask, relative_distance=relative_distance, conv_mask=conv_mask, cache=cache)
    given.update(key_hidden_states=key_hidden_states, value_hidden_states=value_hidden_states)
    if not ported.switched(self.config):
        return type(self).forward(self, hidden_states, **given, cache_offset=cache_offset, **kwargs)
    keys = hidden_states if key_hidden_states is None else key_hidden_states
    values = hidden_states if value_hidden_states is None else value_hidden_states
    input_shape, positions = hidden_states.shape[:-1], kwargs["position_ids"]
    query = self.q_proj(hidden_states, positions)
    key = self.k_proj(keys, cache=cache, conv_mask=conv_mask, cache_offset=cache_offset, **kwargs)
    value = self.v_proj(values, cache=cache, conv_mask=conv_mask, cache_offset=cache_offset, **kwargs)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx + cache_offset, kwargs=kwargs)
    bias = self.relative_position_bias
    states = bias.norm(bias.linear(hidden_states).view(*input_shape, bias.num_heads, -1), positions)
    rows = (states @ bias.proj).transpose(1, 2)  # (B, H, Tq, rel_extent): the model's rel_logits
    out, weights = ported.attend(
        self,
        query,
        key,
        value,
        attention_mask,
        sliding_window=self.sliding_window,
        score_bias=RelativeBias(rows, current_step.get().q_cols),
        s_aux=self.sink_proj(hidden_states).transpose(1, 2),  # (B, H, Tq): a sink logit per query and head
        **kwargs,
    )
    return self.o_proj(out.reshape(*input_shape, -1).contiguous(), hidden_states), weights


def _residual(self, block_states, partial_block_states):
    """transformers' Inkling2BlockAttentionResidual.forward (5.x) through the family's eager attention: each token
    attends over its own layers' states, which never leave its rank."""
    import torch

    if not ported.switched(self.config):
        return type(self).forward(self, block_states, partial_block_states)
    stacked = self.norm(torch.cat([block_states, partial_block_states.unsqueeze(-2)], dim=-2).float())
    hidden_size = stacked.shape[-1]
    query = self.query.float().view(-1, hidden_size).expand(*stacked.shape[:-2], -1, -1)
    out, _ = eager_of(self)(self, query, stacked, stacked, None, scaling=hidden_size**-0.5)
    return out.transpose(1, 2).unbind(-2)


def eager_of(module):
    """The eager attention of the module's own modeling file (Inkling 2's, Inkling 2 Loop's: the same function)."""
    return sys.modules[type(module).__module__].eager_attention_forward


def apply(model, prefix: str = "Inkling2", extra: tuple = ()):
    """Patch every Inkling 2 attention and attention residual of `model` (reversible); returns undo(). `prefix`: the
    classes' (Inkling 2 Loop's are "Inkling2Loop..."); `extra`: more (class name, forward) ports of the family's."""
    undo = [
        ported.port(model, prefix + name, _forward, lambda module: {}) for name in ("SlidingAttention", "FullAttention")
    ]
    undo.append(ported.port(model, prefix + "BlockAttentionResidual", _residual, lambda module: {}))
    undo += [ported.port(model, name, forward, lambda module: {}) for name, forward in extra]

    def undo_all():
        for u in reversed(undo):
            u()

    return undo_all
