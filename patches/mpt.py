"""MPT: its hand-written attention ported to transformers' AttentionInterface (patches/ported.py), ALiBi as a score
bias from global columns (patches/alibi.py).

`MptAttention` splits a fused QKV projection (clamped to `clip_qkv` where set), updates the cache, scores
q.k * softmax_scale plus the model's ALiBi table (fp32 slopes times each key's column relative to the last key, up
to `max_seq_len` keys), masks, softmaxes in fp32 and applies dropout. Under context parallelism the ported forward
computes q/k/v and updates the cache as it does, then calls hf-contextpar's attention with that bias as a function
of each block's global key columns (`alibi.MptAlibi`), so nothing of it travels. Under transformers' own attention
the model's forward runs unchanged.

`MptModel.forward` turns its mask into bool with `.to(torch.bool)`, which fails on the None hf-contextpar's mask
function returns for an unpadded forward (its attention reads the padding from the plan): while patched, MPT's
`create_causal_mask` gives that forward a mask object whose `.to` is None again (`_NoMask`).
"""

from __future__ import annotations

from . import ported
from .alibi import MptAlibi


def _forward(self, hidden_states, position_bias=None, cache=None, attention_mask=None, **kwargs):
    """transformers' MptAttention.forward (5.x), through hf-contextpar's attention with ALiBi as a score bias."""
    kwargs.pop("past_key_values", None)
    if not ported.switched(self.config):
        return type(self).forward(
            self, hidden_states, position_bias, cache=cache, attention_mask=attention_mask, **kwargs
        )
    batch, length = hidden_states.shape[:2]
    mixed = self.Wqkv(hidden_states)
    if self.clip_qkv:
        mixed = mixed.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    shape = (batch, length, self.n_heads, self.head_dim)
    query, key, value = (t.reshape(shape).transpose(1, 2) for t in mixed.chunk(3, dim=2))
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    attention = ported.attention_function(self.config, ported.eager)
    dropout = self.attn_dropout_p if self.training else 0.0
    bias = MptAlibi(self.n_heads, self.max_seq_length)
    out, _ = attention(
        self, query, key, value, attention_mask, scaling=self.softmax_scale, dropout=dropout, score_bias=bias
    )
    return self.out_proj(out.reshape(batch, length, -1)), None


class _NoMask:
    """An unpadded forward's mask under hf-contextpar: MptModel calls `.to(torch.bool)` on it, which gives None."""

    def to(self, *args, **kwargs):
        return None


_installed = [0, None]  # how many MPT models are patched, transformers' create_causal_mask while any is


def _mask_patch():
    """MPT's module-level create_causal_mask, wrapped while a model is patched: None under hf-contextpar becomes a
    `_NoMask` (only for a config naming hf-contextpar's attention; any other model is untouched). Returns undo()."""
    from transformers.models.mpt import modeling_mpt

    if _installed[0] == 0:
        original = _installed[1] = modeling_mpt.create_causal_mask

        def create_causal_mask(*args, **kwargs):
            mask = original(*args, **kwargs)
            config = kwargs.get("config", args[0] if args else None)
            return _NoMask() if mask is None and ported.switched(config) else mask

        modeling_mpt.create_causal_mask = create_causal_mask
    _installed[0] += 1

    def undo():
        _installed[0] -= 1
        if _installed[0] == 0:
            modeling_mpt.create_causal_mask = _installed[1]

    return undo


def apply(model):
    """Port every MptAttention of `model` (reversible); returns undo()."""
    undo_port = ported.port(
        model, "MptAttention", _forward, lambda module: dict(config=model.config, num_key_value_groups=1)
    )
    undo_mask = _mask_patch()

    def undo():
        undo_mask()
        undo_port()

    return undo
