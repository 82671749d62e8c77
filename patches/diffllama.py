"""DiffLlama: differential attention as one attention call, its two halves of V side by side.

`DiffLlamaAttention.forward` computes (softmax(Q K^T) - lambda softmax(Q K^T)) V head-pair by head-pair with
two attention calls sharing the query and the cache's keys: one with V1 and one with V2, the first and the
second half of the cache's KV heads each repeated twice (`torch.chunk(value_states, 2, dim=1)`, then
`.repeat(1, 2, 1, 1)`), and concatenates the outputs on the last dim. hf-contextpar takes each layer's K/V
from its sharded cache and refuses a layer attending twice, or with other values than the cache returned.
The same softmax weights applied to [V1 | V2] (values twice as wide) give both outputs side by side, the
model's concatenation, in one call. So this patch gives each module an `expand_kv(k, v) -> (k, [V1 | V2])`
and a forward that attends once with it: hf-contextpar's latent-KV path (attention/latent.py) sends the
cached K/V blocks and expands each block a rank receives with the module's own expansion, as for MLA. The
expansion mixes KV heads (head j's values with head j +- Hkv/2's), so Ulysses, which splits the KV heads
between ranks, is refused for it.
"""

from __future__ import annotations

import types

import torch


def _expand_kv(key_states, value_states):
    """The model's two value tensors, side by side: (B, Hkv, T, D) -> keys as they are, values (B, Hkv, T, 2 D)."""
    value_1, value_2 = (v.repeat(1, 2, 1, 1) for v in torch.chunk(value_states, 2, dim=1))
    return key_states, torch.cat([value_1, value_2], dim=-1)


def _forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
    """transformers' DiffLlamaAttention.forward (5.x), with its two attention calls as one over [V1 | V2]."""
    from transformers.models.diffllama.modeling_diffllama import (
        ALL_ATTENTION_FUNCTIONS,
        apply_rotary_pos_emb,
        eager_attention_forward,
    )

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
    if cache is not None:
        key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
    key_states, values = self.expand_kv(key_states, value_states)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
    # (B, T, H, 2 D): the model's torch.cat([attn_output1, attn_output2], dim=-1)
    attn_output, attn_weights = attention(
        self, query_states, key_states, values, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs
    )
    # from here on transformers' own arithmetic
    attn_output1, attn_output2 = torch.chunk(attn_output, 2, dim=2)
    lambda_1 = torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1, dim=-1, dtype=torch.float32)).to(query_states.dtype)
    lambda_2 = torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2, dim=-1, dtype=torch.float32)).to(query_states.dtype)
    lambda_full = lambda_1 - lambda_2 + self.lambda_init
    attn_output = attn_output1 - lambda_full * attn_output2
    attn_output = (1 - self.lambda_init) * self.groupnorm(attn_output)
    attn_output = attn_output.reshape(*input_shape, -1)
    return self.o_proj(attn_output), attn_weights


def apply(model):
    """Give every DiffLlamaAttention `expand_kv` and the one-call forward (instance attributes); returns undo()."""
    modules = [m for m in model.modules() if type(m).__name__ == "DiffLlamaAttention"]
    for module in modules:
        module.expand_kv = _expand_kv
        module.forward = types.MethodType(_forward, module)

    def undo():
        for module in modules:
            module.__dict__.pop("forward", None)
            module.__dict__.pop("expand_kv", None)

    return undo
