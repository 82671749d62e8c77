"""Falcon: its hand-written attention ported to transformers' AttentionInterface (patches/ported.py), RoPE or ALiBi.

`FalconAttention` splits a fused QKV projection (multi-query: one K/V head; the new decoder architecture: K/V heads
broadcast to every query head before the cache; else one K/V head per head), applies RoPE, updates the cache and
attends with 1 / sqrt(head_dim), through torch's SDPA when the config names it and its own matmuls otherwise (no
dropout on this path). The ported forward computes q/k/v and updates the cache as it does, then calls the attention
the config names, so hf-contextpar's attention takes over under context parallelism.

`alibi=True` (Falcon-RW) skips RoPE and adds a per-head bias linear in each key's position (counted over real
tokens) to the scores: the model folds alibi / sqrt(head_dim) into the 4D mask it builds for SDPA. Under context
parallelism the ported forward hands hf-contextpar's attention that bias as a function of each block's global key
columns (`alibi.BloomAlibi` with `falcon=True`: the model's bf16 product, value for value), so nothing of it
travels; under transformers' own attention the model's forward runs unchanged. Its eager path adds ALiBi twice (in
the scores and again in the mask it folded it into: 0.05 from SDPA's logits on a tiny fp64 model), so an ALiBi
model loaded with attn_implementation="eager" is refused: one process computes something else than the ALiBi its
SDPA path (the default) computes.
"""

from __future__ import annotations

import torch

from hf_contextpar.errors import UnsupportedModelError

from . import ported
from .alibi import BloomAlibi


def check(config):
    """Refuse ALiBi under transformers' eager attention, which adds the bias twice (the module docstring)."""
    if getattr(config, "alibi", False) and config._attn_implementation == "eager":
        raise UnsupportedModelError(
            "this Falcon configuration uses ALiBi (alibi=True, as Falcon-RW does) and was loaded with "
            "attn_implementation='eager', whose attention adds the ALiBi bias twice (in its scores and again in the "
            "mask the model folded it into), unlike its SDPA path, which hf-contextpar computes exactly. Load it "
            "with attn_implementation='sdpa' (the default)."
        )


def _eager(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """The model's own non-SDPA attention (scores / sqrt(d), mask, softmax in the model's dtype, no dropout)."""
    scores = query @ key.transpose(-1, -2)
    scores /= module.head_dim**0.5
    weights = torch.nn.functional.softmax(scores + attention_mask, dim=-1, dtype=query.dtype)
    return (weights @ value).transpose(1, 2).contiguous(), weights


def _qkv(self, hidden_states, position_embeddings, rope=True):
    """The model's query, key and value heads, RoPE applied (not for ALiBi)."""
    from transformers.models.falcon.modeling_falcon import apply_rotary_pos_emb

    query, key, value = self._split_heads(self.query_key_value(hidden_states))
    batch, length = query.shape[:2]
    kv_heads = self.num_heads if self.new_decoder_architecture else self.num_kv_heads
    query = query.transpose(1, 2).reshape(batch, self.num_heads, length, self.head_dim)
    key = key.transpose(1, 2).reshape(batch, kv_heads, length, self.head_dim)
    value = value.transpose(1, 2).reshape(batch, kv_heads, length, self.head_dim)
    if rope:
        query, key = apply_rotary_pos_emb(query, key, *position_embeddings)
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
    """transformers' FalconAttention.forward (5.x), through the attention interface (ALiBi: hf-contextpar's only)."""
    if alibi is not None and not ported.switched(self.config):  # transformers' own: the model's forward
        return type(self).forward(
            self, hidden_states, alibi, attention_mask, position_ids, layer_past, use_cache, output_attentions,
            position_embeddings, **kwargs,
        )  # fmt: skip
    query, key, value = _qkv(self, hidden_states, position_embeddings, rope=alibi is None)
    if layer_past is not None:
        key, value = layer_past.update(key, value, self.layer_idx)
    attention = ported.attention_function(self.config, _eager)
    extra = {}
    if alibi is not None:  # hf-contextpar's attention: each rank biases its own key columns
        dropout = self.attention_dropout.p if self.training else 0.0  # the SDPA path's, with ALiBi
        extra = dict(dropout=dropout, score_bias=BloomAlibi(self.num_heads, hidden_states.dtype, True, self.head_dim))
    out, weights = attention(
        self, query, key, value, attention_mask, scaling=self.inv_norm_factor, **{"dropout": 0.0, **extra}
    )
    return self.dense(out.reshape(*hidden_states.shape[:-1], -1)), weights


def apply(model):
    """Port every FalconAttention of `model` (reversible); returns undo()."""

    def attributes(module):
        kv_heads = module.num_heads if module.new_decoder_architecture else module.num_kv_heads
        return dict(num_key_value_groups=module.num_heads // kv_heads)

    return ported.port(model, "FalconAttention", _forward, attributes)
