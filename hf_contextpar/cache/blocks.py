"""The K/V block: one layer's keys and values as the cache stores them and as they travel.

(2, B, Hkv, T, D), head-major, so every head's keys are contiguous rows for the kernels; keys and
values of different head sizes side by side, (1, B, Hkv, T, Dk + Dv). The cache, the messages and
the attention algorithms all read this one format.
"""

from __future__ import annotations

import torch


def unpack_kv(kv: torch.Tensor, key_dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v), each (B, Hkv, T, D), from a K/V block (2, B, Hkv, T, D): head-major, as the cache
    stores it and as it is sent, so every head's keys are contiguous rows for the kernels. Keys and
    values of different head sizes travel side by side, (1, B, Hkv, T, Dk + Dv), split at key_dim."""
    if kv.shape[0] == 2:
        return kv.unbind(0)  # one op for both views (decode reads them per layer per token)
    return kv[0, ..., :key_dim], kv[0, ..., key_dim:]


def pack_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The K/V block `unpack_kv` reads: (2, ...) for keys and values of one head size, else side by side."""
    return torch.stack([k, v]) if k.shape[-1] == v.shape[-1] else torch.cat([k, v], dim=-1).unsqueeze(0)


def block_shape(like: torch.Tensor, tokens: int) -> tuple:
    """The shape of a K/V block like `like` holding `tokens` tokens (a message of another rank's size)."""
    return (*like.shape[:3], tokens, like.shape[4])
