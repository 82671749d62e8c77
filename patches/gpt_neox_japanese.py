"""GPT-NeoX-Japanese: its hand-written attention ported to transformers' AttentionInterface (patches/ported.py).

`GPTNeoXJapaneseAttention` splits a fused QKV projection per head, applies RoPE to the first `rotary_ndims` dims,
updates the cache and attends with `baddbmm(alpha=1 / sqrt(head_size))`, the model's causal mask added; the last
layer hands its output bias to the block. The ported forward computes q/k/v and updates the cache as it does, then
calls the attention the config names with `scaling=1 / norm_factor`, so hf-contextpar's attention takes over under
context parallelism. Its eager path is the module's own `_attn`.
"""

from __future__ import annotations

import torch

from . import ported


def _eager(module, query, key, value, attention_mask, **kwargs):
    """The model's own attention (`GPTNeoXJapaneseAttention._attn`), as an attention function."""
    out, weights = module._attn(query, key, value, attention_mask)
    return out.transpose(1, 2).contiguous(), weights


def _qkv(self, hidden_states, position_embeddings):
    """The model's query, key and value: its fused projection split per head, RoPE on the rotary dims."""
    from transformers.models.gpt_neox_japanese.modeling_gpt_neox_japanese import apply_rotary_pos_emb

    qkv = self.query_key_value(hidden_states)
    qkv = qkv.view(*qkv.shape[:-1], self.num_attention_heads, 3 * self.head_size)
    query, key, value = (qkv[..., i * self.head_size : (i + 1) * self.head_size].permute(0, 2, 1, 3) for i in range(3))
    cos, sin = position_embeddings
    rot = self.rotary_ndims
    query_rot, key_rot = apply_rotary_pos_emb(query[..., :rot], key[..., :rot], cos, sin)
    query = torch.cat((query_rot, query[..., rot:]), dim=-1).contiguous()
    key = torch.cat((key_rot, key[..., rot:]), dim=-1).contiguous()
    return query, key, value


def _forward(
    self,
    hidden_states,
    attention_mask,
    position_ids,
    layer_past=None,
    use_cache=False,
    output_attentions=False,
    position_embeddings=None,
    **kwargs,
):
    """transformers' GPTNeoXJapaneseAttention.forward (5.x), through the attention interface."""
    query, key, value = _qkv(self, hidden_states, position_embeddings)
    if layer_past is not None:
        key, value = layer_past.update(key, value, self.layer_idx)
    attention = ported.attention_function(self.config, _eager)
    dropout = self.attention_dropout.p if self.training else 0.0
    out, weights = attention(self, query, key, value, attention_mask, scaling=1.0 / self.norm_factor, dropout=dropout)
    out = self.dense(out.reshape(*hidden_states.shape[:-1], -1))
    return out, weights, self.dense_bias


def apply(model):
    """Port every GPTNeoXJapaneseAttention of `model` (reversible); returns undo()."""
    config = model.config

    def attributes(module):
        return dict(config=config, num_key_value_groups=1, is_causal=True)

    return ported.port(model, "GPTNeoXJapaneseAttention", _forward, attributes)
