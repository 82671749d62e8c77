"""Metrics for "does context parallelism change anything?"."""

from __future__ import annotations

import torch


def logits_diff(a: torch.Tensor, b: torch.Tensor, attention_mask: torch.Tensor | None = None) -> float:
    """Max |a - b| over (B, T, V) logits, ignoring padded positions (their values are kernel-specific)."""
    if a.shape != b.shape:
        raise ValueError(f"logit shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    d = (a.double() - b.double()).abs()
    if attention_mask is not None:
        d = d[attention_mask.bool()[:, -a.shape[1]:]]
    return float(d.max()) if d.numel() else 0.0


def first_divergence(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """First sequence index where token tensors (B, T) differ in any row, or None if identical."""
    if a.shape != b.shape:
        return min(a.shape[-1], b.shape[-1])
    diff = (a != b).any(dim=0).nonzero()
    return int(diff[0]) if diff.numel() else None
