"""JetMoE: its mixture of attention heads attends once with the cache's K/V, its query heads in GQA order.

`JetMoeAttention.forward` routes each token to `top_k` query experts, giving `top_k x Hkv` query heads (head
k * Hkv + j: expert slot k, KV head j), and after the cache update repeats the K/V `top_k` times along the
heads (`key_states.repeat(1, top_k, 1, 1)`: tiled, not interleaved as GQA's repeat_kv), so query head
k * Hkv + j attends with KV head j. hf-contextpar takes each layer's K/V from its sharded cache and refuses
an attention handed other tensors than the cache returned (the repeat is a copy). This patch runs the same
forward with the repeat left out and the query heads permuted into GQA order (head j * top_k + k, which GQA
pairs with KV head j): the attention gets exactly the cache's K/V, every query head attends with the KV
head it attends with on one process, and the output heads are permuted back before the experts' reduce.
A permutation of heads, which attention computes independently: the same arithmetic as one process.
"""

from __future__ import annotations

import types


def _forward(self, hidden_states, attention_mask=None, position_embeddings=None, cache=None, **kwargs):
    """transformers' JetMoeAttention.forward (5.x), attending once with the cache's K/V in GQA head order."""
    from transformers.models.jetmoe.modeling_jetmoe import (
        ALL_ATTENTION_FUNCTIONS,
        apply_rotary_pos_emb,
        eager_attention_forward,
    )

    batch, length = hidden_states.shape[:-1]
    hidden_shape = (batch, length, -1, self.head_dim)
    query_states, router_logits, topo_info = self.experts.map(hidden_states)
    key_states, value_states = self.kv_proj(hidden_states).chunk(2, dim=-1)
    query_states = query_states.view(hidden_shape).transpose(1, 2)
    key_states = key_states.view(hidden_shape).transpose(1, 2)
    value_states = value_states.view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
    if cache is not None:
        key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
    heads, kv_heads = query_states.shape[1], key_states.shape[1]
    # query head k * Hkv + j -> j * top_k + k: GQA's pairing of query heads with KV heads is the model's tiling
    gqa = query_states.view(batch, self.top_k, kv_heads, length, self.head_dim).transpose(1, 2)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
    attn_output, attn_weights = attention(
        self,
        gqa.reshape(batch, heads, length, self.head_dim),
        key_states,
        value_states,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        **kwargs,
    )
    # (B, T, Hkv, top_k, D) back to the model's (B, T, top_k, Hkv x D)
    attn_output = attn_output.view(batch, length, kv_heads, self.top_k, self.head_dim).transpose(2, 3)
    attn_output = self.experts.reduce(attn_output.reshape(batch, length, self.top_k, -1), topo_info)
    return attn_output.view(batch, length, -1), attn_weights, router_logits


def apply(model):
    """Give every JetMoeAttention the forward above (an instance attribute over the class's) and GQA's group size
    (the model sets 1: it repeats the K/V itself; hf-contextpar's attention reads the groups off the shapes, an eager
    or SDPA attention off this); returns undo()."""
    modules = [(m, m.num_key_value_groups) for m in model.modules() if type(m).__name__ == "JetMoeAttention"]
    for module, _ in modules:
        module.forward = types.MethodType(_forward, module)
        module.num_key_value_groups = module.top_k

    def undo():
        for module, groups in modules:
            module.__dict__.pop("forward", None)
            module.num_key_value_groups = groups

    return undo
