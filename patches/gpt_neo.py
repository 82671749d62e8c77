"""GPT-Neo: its hand-written attention ported to transformers' AttentionInterface (patches/ported.py).

`GPTNeoSelfAttention` attends unscaled (no 1/sqrt(d)), its scores in fp32 whatever the model's dtype, its "local"
layers (alternating with "global" ones in GPT-Neo 125M to 2.7B) through a mask buffer that keeps the keys less than
`config.window_size` tokens back: transformers' `sliding_window` (distance < window). The ported forward computes
q/k/v and updates the cache as it does, then calls the attention the config names with `scaling=1.0` and, on a local
layer, `sliding_window=window_size`, so hf-contextpar's attention takes over under context parallelism (its scores
accumulate in fp32 for a bf16 or fp16 model, as the model's do; an fp64 model's stay fp64, which the census measures
against the model's own fp32 scores). Its eager path is the module's own `_attn`: one process computes exactly
what it did before the port.
"""

from __future__ import annotations

from . import ported


def _eager(module, query, key, value, attention_mask, **kwargs):
    """The model's own attention (`GPTNeoSelfAttention._attn`: fp32 scores, its window buffer), as a function."""
    out, weights = module._attn(query, key, value, attention_mask)
    return out.transpose(1, 2).contiguous(), weights


def _forward(self, hidden_states, attention_mask=None, layer_past=None, use_cache=False, output_attentions=False, **kw):
    """transformers' GPTNeoSelfAttention.forward (5.x), through the attention interface."""
    batch, length, _ = hidden_states.shape
    shape = (batch, length, self.num_heads, self.head_dim)
    query = self.q_proj(hidden_states).view(shape).transpose(1, 2)
    key = self.k_proj(hidden_states).view(shape).transpose(1, 2)
    value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
    if layer_past is not None:
        key, value = layer_past.update(key, value, self.layer_id)
    attention = ported.attention_function(self.config, _eager)
    window = self.config.window_size if self.attention_type == "local" else None
    dropout = self.config.attention_dropout if self.training else 0.0
    out, weights = attention(
        self, query, key, value, attention_mask, scaling=1.0, dropout=dropout, sliding_window=window
    )
    out = self.out_proj(out.reshape(batch, length, self.embed_dim))
    return self.resid_dropout(out), weights


def apply(model):
    """Port every GPTNeoSelfAttention of `model` (reversible); returns undo()."""

    def attributes(module):
        return dict(layer_idx=module.layer_id, num_key_value_groups=1)

    return ported.port(model, "GPTNeoSelfAttention", _forward, attributes)
