"""XGLM: its hand-written attention ported to transformers' AttentionInterface (patches/ported.py).

`XGLMAttention.forward` scales the query by head_dim ** -0.5 before its own bmm, adds the model's causal mask,
softmaxes and applies dropout. The ported forward computes q/k/v and updates the cache as it does, then hands the
scaled query to the attention the config names with `scaling=1.0` (the same products), so hf-contextpar's attention
takes over under context parallelism. Cross-attention (`key_value_states`, only with `add_cross_attention`) keeps the
model's own forward: the causal LM never passes it.
"""

from __future__ import annotations

from . import ported


def _forward(self, hidden_states, key_value_states=None, cache=None, attention_mask=None, **kwargs):
    """transformers' XGLMAttention.forward (5.x) for self-attention, through the attention interface."""
    if key_value_states is not None:
        return type(self).forward(self, hidden_states, key_value_states, cache, attention_mask, **kwargs)
    batch, length, _ = hidden_states.shape
    shape = (batch, length, -1, self.head_dim)
    query = (self.q_proj(hidden_states) * self.scaling).view(shape).transpose(1, 2)
    key = self.k_proj(hidden_states).view(shape).transpose(1, 2)
    value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    attention = ported.attention_function(self.config, ported.eager)
    dropout = self.dropout if self.training else 0.0
    out, weights = attention(self, query, key, value, attention_mask, scaling=1.0, dropout=dropout, **kwargs)
    return self.out_proj(out.reshape(batch, length, self.embed_dim)), weights


def apply(model):
    """Port every XGLMAttention of `model` (reversible); returns undo()."""
    config = model.config

    def attributes(module):
        return dict(config=config, num_key_value_groups=1, is_causal=True)

    return ported.port(model, "XGLMAttention", _forward, attributes)
