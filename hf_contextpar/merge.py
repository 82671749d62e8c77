"""Exact combination of attention partials over disjoint key sets (Meta CP paper, App. B).

With partial outputs O_s and log-sum-exps L_s:  L = logsumexp_s L_s,  O = sum_s exp(L_s - L) O_s.
Everything is fp32 (or fp64 for fp64 models). Rows that saw no key at all carry L = -inf and
O = 0, and stay that way instead of turning into NaN.
"""

from __future__ import annotations

import torch


def _safe(lse: torch.Tensor) -> torch.Tensor:
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def merge_pair(out_a, lse_a, out_b, lse_b):
    """Merge two partials. out: (..., T, D), lse: (..., T). Returns a new (out, lse)."""
    lse = torch.logaddexp(lse_a, lse_b)
    ref = _safe(lse)
    out = out_a * torch.exp(lse_a - ref).unsqueeze(-1) + out_b * torch.exp(lse_b - ref).unsqueeze(-1)
    return out, lse


def merge_stacked(outs: torch.Tensor, lses: torch.Tensor):
    """Merge partials stacked on dim 0 (outs: (S, ..., T, D), lses: (S, ..., T)) in one fixed order."""
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - _safe(lse).unsqueeze(0))
    return (outs * weights.unsqueeze(-1)).sum(dim=0), lse


class Accumulator:
    """Running merge of partials for one set of query rows (the ring's inner loop)."""

    def __init__(self):
        self.out = None
        self.lse = None

    def add(self, out, lse):
        if out is None:
            return
        if self.out is None:
            self.out, self.lse = out, lse
        else:
            self.out, self.lse = merge_pair(self.out, self.lse, out, lse)


def pack_partial(res, shape, dtype, device):
    """(out, lse) -> one (B, H, T, D+1) tensor for a collective; None (nothing visible) -> zeros / -inf."""
    b, h, t, d = shape
    packed = torch.empty((b, h, t, d + 1), dtype=dtype, device=device)
    if res is None:
        packed[..., :d], packed[..., d] = 0.0, -float("inf")
    else:
        packed[..., :d], packed[..., d] = res[0], res[1]
    return packed


def merge_packed(stacked):
    """Merge partials packed by `pack_partial` and stacked on dim 0, in that (rank) order."""
    return merge_stacked(stacked[..., :-1], stacked[..., -1])
