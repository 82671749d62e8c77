"""Falcon (its RoPE configurations): its hand-written attention ported to transformers' AttentionInterface
(patches/ported.py); its ALiBi configurations refused.

`FalconAttention` splits a fused QKV projection (multi-query: one K/V head; the new decoder architecture: K/V heads
broadcast to every query head before the cache; else one K/V head per head), applies RoPE, updates the cache and
attends with 1 / sqrt(head_dim), through torch's SDPA when the config names it and its own matmuls otherwise (no
dropout on this path). The ported forward computes q/k/v and updates the cache as it does, then calls the attention
the config names, so hf-contextpar's attention takes over under context parallelism.

`alibi=True` (Falcon-RW) adds a per-head bias linear in the key's position to the scores, folded into the mask the
model builds; hf-contextpar's attention builds its masks from each rank's global columns and takes no score bias, so
those configurations are refused (`check`) rather than run inexactly.
"""

from __future__ import annotations

import torch

from hf_contextpar.errors import UnsupportedModelError

from . import ported


def check(config):
    """Refuse the ALiBi configurations: their bias travels in the model's own mask, which hf-contextpar replaces."""
    if getattr(config, "alibi", False):
        raise UnsupportedModelError(
            "this Falcon configuration uses ALiBi (alibi=True, as Falcon-RW does): the model adds a per-head bias "
            "linear in each key's position to the attention scores through its own mask, which hf-contextpar's "
            "attention does not take (it builds masks from each rank's global columns). Falcon's RoPE "
            "configurations (alibi=False: Falcon-7B/40B/180B) run under context parallelism; run this one on one "
            "process."
        )


def _eager(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """The model's own non-SDPA attention (scores / sqrt(d), mask, softmax in the model's dtype, no dropout)."""
    scores = query @ key.transpose(-1, -2)
    scores /= module.head_dim**0.5
    weights = torch.nn.functional.softmax(scores + attention_mask, dim=-1, dtype=query.dtype)
    return (weights @ value).transpose(1, 2).contiguous(), weights


def _qkv(self, hidden_states, position_embeddings):
    """The model's query, key and value heads, RoPE applied."""
    from transformers.models.falcon.modeling_falcon import apply_rotary_pos_emb

    query, key, value = self._split_heads(self.query_key_value(hidden_states))
    batch, length = query.shape[:2]
    kv_heads = self.num_heads if self.new_decoder_architecture else self.num_kv_heads
    query = query.transpose(1, 2).reshape(batch, self.num_heads, length, self.head_dim)
    key = key.transpose(1, 2).reshape(batch, kv_heads, length, self.head_dim)
    value = value.transpose(1, 2).reshape(batch, kv_heads, length, self.head_dim)
    cos, sin = position_embeddings
    query, key = apply_rotary_pos_emb(query, key, cos, sin)
    return query, key, value


def _forward(
    self,
    hidden_states,
    alibi,
    attention_mask,
    position_ids=None,
    layer_past=None,
    use_cache=False,
    output_attentions=False,
    position_embeddings=None,
    **kwargs,
):
    """transformers' FalconAttention.forward (5.x) without ALiBi, through the attention interface."""
    if alibi is not None:  # refused under context parallelism (check): the model's own forward
        return type(self).forward(
            self, hidden_states, alibi, attention_mask, position_ids, layer_past, use_cache, output_attentions,
            position_embeddings, **kwargs,
        )  # fmt: skip
    query, key, value = _qkv(self, hidden_states, position_embeddings)
    if layer_past is not None:
        key, value = layer_past.update(key, value, self.layer_idx)
    attention = ported.attention_function(self.config, _eager)
    out, weights = attention(self, query, key, value, attention_mask, scaling=self.inv_norm_factor, dropout=0.0)
    return self.dense(out.reshape(*hidden_states.shape[:-1], -1)), weights


def apply(model):
    """Port every FalconAttention of `model` (reversible); returns undo()."""

    def attributes(module):
        kv_heads = module.num_heads if module.new_decoder_architecture else module.num_kv_heads
        return dict(num_key_value_groups=module.num_heads // kv_heads)

    return ported.port(model, "FalconAttention", _forward, attributes)
