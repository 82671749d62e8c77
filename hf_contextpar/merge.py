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
