"""BLOOM: its hand-written attention ported to transformers' AttentionInterface (patches/ported.py), ALiBi as a
score bias from global columns (patches/alibi.py).

`BloomAttention` splits a fused QKV projection (one K/V head per head), updates the cache, and scores
alibi + q.k / sqrt(d) in one baddbmm, where `alibi` is the model's per-head slope times each key's position counted
over real tokens; then the causal mask, a softmax in fp32, dropout, the values and the output projection (split in
`pretraining_tp` slices where `slow_but_exact`). Under context parallelism the ported forward computes q/k/v and
updates the cache as it does, then calls hf-contextpar's attention with the ALiBi bias as a function of each block's
global key columns (`alibi.BloomAlibi`: the model's formula, value for value), so each rank biases its own blocks
and nothing of the bias travels. Under transformers' own attention the model's forward runs unchanged.
"""

from __future__ import annotations

import torch

from . import ported
from .alibi import BloomAlibi


def _forward(
    self,
    hidden_states,
    residual,
    alibi,
    attention_mask,
    layer_past=None,
    use_cache=False,
    output_attentions=False,
    **kw,
):
    """transformers' BloomAttention.forward (5.x), through hf-contextpar's attention with ALiBi as a score bias."""
    if not ported.switched(self.config):
        return type(self).forward(
            self, hidden_states, residual, alibi, attention_mask, layer_past, use_cache, output_attentions, **kw
        )
    from transformers.models.bloom.modeling_bloom import dropout_add

    batch, length, _ = hidden_states.shape
    query, key, value = self._reshape(self.query_key_value(hidden_states))
    if layer_past is not None:
        key, value = layer_past.update(key, value, self.layer_idx)
    attention = ported.attention_function(self.config, ported.eager)
    dropout = self.attention_dropout.p if self.training else 0.0
    bias = BloomAlibi(self.num_heads, hidden_states.dtype)
    out, _ = attention(
        self, query, key, value, attention_mask, scaling=self.inv_norm_factor, dropout=dropout, score_bias=bias
    )
    context = out.reshape(batch, length, self.hidden_size)
    if self.pretraining_tp > 1 and self.slow_but_exact:  # the model's slices, summed in its order
        output = 0
        step = self.hidden_size / self.pretraining_tp
        for i in range(self.pretraining_tp):
            cut = slice(int(i * step), int((i + 1) * step))
            output = output + torch.nn.functional.linear(context[:, :, cut], self.dense.weight[:, cut])
    else:
        output = self.dense(context)
    return dropout_add(output, residual, self.hidden_dropout, self.training), None


def apply(model):
    """Port every BloomAttention of `model` (reversible); returns undo()."""
    return ported.port(
        model, "BloomAttention", _forward, lambda module: dict(config=model.config, num_key_value_groups=1)
    )
