"""Doge: its dynamic mask attention's per-key bias as a score bias computed from each key's values
(hf_contextpar/attention/bias.py), so it travels with its key.

`DogeAttention` adds to every score of key k the bias exp(A * softplus(dt_proj(v_k))) of that key's KV head, v_k the
key's values over all its KV heads (`dt_states`), which it folds into the 4D mask it hands the attention function
(`prepare_dynamic_mask`), and beyond `keep_window_size` keys (2048 by default) keeps only each query's top
`keep_window_size` keys by that bias. Under hf-contextpar's attention the patched forward hands the bias as a
function of each block's values (`DynamicBias`, `reads_values`): every rank computes it for the blocks it attends,
from the values that arrive with their keys, so nothing more travels; Ulysses, which splits a token's KV heads
between ranks, is refused. The top-k over a whole row is not built: a forward over more than `keep_window_size`
keys is refused. Under transformers' own attention the model's forward runs unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import ported


@dataclass(frozen=True, eq=False)
class DynamicBias:
    """Doge's per-key bias, (B, H, 1, Tk) from the keys' values (B, Hkv, Tk, D): the model's `dt_states`, repeated
    over each KV head's query heads. One per layer (its module's weights)."""

    module: object
    max_length: int  # keep_window_size: beyond it the model keeps each row's top keys (not built: refused)
    reads_values = True

    def __call__(self, bias, q_cols, k_cols, values):
        m = self.module
        dt = m.dt_proj(values.transpose(1, 2).reshape(values.shape[0], values.shape[-2], -1))
        dt = torch.exp(m.A * torch.nn.functional.softplus(dt)).transpose(-1, -2)  # (B, Hkv, Tk)
        return dt.repeat_interleave(m.num_key_value_groups, dim=1)[:, :, None, :]


def _forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
    """transformers' DogeAttention.forward (5.x) with its dynamic bias from each block's values (hf-contextpar's
    attention only)."""
    kwargs.pop("past_key_values", None)
    if not ported.switched(self.config):
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
    from transformers.models.doge.modeling_doge import apply_rotary_pos_emb

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    key = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    query, key = apply_rotary_pos_emb(query, key, *position_embeddings)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    out, weights = ported.attend(
        self,
        query,
        key,
        value,
        attention_mask,
        score_bias=DynamicBias(self, self.keep_window_size),
        **kwargs,
    )
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def apply(model):
    """Patch every DogeAttention of `model` (reversible); returns undo()."""
    return ported.port(model, "DogeAttention", _forward, lambda module: {})
