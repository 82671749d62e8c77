"""ALiBi as BLOOM, Falcon (alibi=True) and MPT compute it, as score biases from global columns
(hf_contextpar/attention/bias.py): each rank evaluates its own key columns' bias, so nothing of it travels.

ALiBi adds slope_h * position(key) to head h's scores. Softmax ignores a constant per query row, but the blocks'
partials are merged by their LSE and the model's bias is rounded in its own dtype, so each formula below is the
model's exactly, value for value (same dtypes, same operations):

- BLOOM (`build_alibi_tensor`): fp32 slopes times the key's position counted over real tokens,
  (cumsum(mask) - 1) * mask (a left-padded row's first real token is 0), cast to the model's dtype;
- Falcon (its own `build_alibi_tensor`): BLOOM's positions and slopes, the product in bf16, cast to the model's
  dtype, divided by sqrt(head_dim) as the model folds it into its SDPA mask;
- MPT (`build_mpt_alibi_tensor`, alibi_bias_max 8 as the model calls it): fp32 slopes times (column - length + 1),
  the key's column relative to the forward's last key, whatever the padding; defined up to `max_seq_len` keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def _positions(bias, device) -> torch.Tensor:
    """(B, length) or (1, length): each key's position counted over real tokens (BLOOM's and Falcon's), per forward."""
    if "positions" not in bias.memo:
        if bias.padding is None:
            bias.memo["positions"] = torch.arange(bias.length, device=device)[None]
        else:
            mask = bias.padding.to(device=device, dtype=torch.long)
            bias.memo["positions"] = (mask.cumsum(dim=-1) - 1) * mask
    return bias.memo["positions"]


def _at(table: torch.Tensor, k_cols: torch.Tensor) -> torch.Tensor:
    """table (B | 1, length) read at k_cols (Tk,) or (B, Tk): (B | 1, Tk)."""
    if k_cols.dim() == 1:
        return table[:, k_cols]
    return table.expand(k_cols.shape[0], -1).gather(1, k_cols)


@dataclass(frozen=True)
class BloomAlibi:
    """BLOOM's ALiBi (Falcon's with `falcon=True`): per key, (B | 1, H, 1, Tk)."""

    heads: int
    dtype: torch.dtype
    falcon: bool = False
    head_dim: int = 0  # Falcon: the bias is divided by sqrt(head_dim)

    def __call__(self, bias, q_cols, k_cols):
        from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

        slopes = _get_alibi_slopes(self.heads, k_cols.device)
        positions = _at(_positions(bias, k_cols.device), k_cols)[:, None, :]  # (B | 1, 1, Tk)
        if self.falcon:
            alibi = (slopes[..., None].bfloat16() * positions).to(self.dtype) / math.sqrt(self.head_dim)
        else:
            alibi = (slopes[..., None] * positions).to(self.dtype)
        return alibi[:, :, None, :]


def mpt_slopes(heads: int, alibi_bias_max: int, device) -> torch.Tensor:
    """`build_mpt_alibi_tensor`'s slopes, (H,) fp32."""
    power = 2 ** math.ceil(math.log2(heads))
    base = torch.arange(1, power + 1, dtype=torch.int64, device=device).float() * (alibi_bias_max / power)
    slopes = 1.0 / torch.pow(2, base)
    if power != heads:
        slopes = torch.concat([slopes[1::2], slopes[::2]])[:heads]
    return slopes


@dataclass(frozen=True)
class MptAlibi:
    """MPT's ALiBi: per key, (1 | B, H, 1, Tk) fp32 (the model adds it to its scores as fp32)."""

    heads: int
    max_length: int  # config.max_seq_len: the model's bias table has this many columns (one process fails beyond)
    alibi_bias_max: int = 8

    def __call__(self, bias, q_cols, k_cols):
        slopes = mpt_slopes(self.heads, self.alibi_bias_max, k_cols.device)
        relative = (k_cols - (bias.length - 1)).to(torch.int32)
        relative = relative[None] if relative.dim() == 1 else relative  # (B | 1, Tk)
        return relative[:, None, None, :] * slopes[None, :, None, None]
