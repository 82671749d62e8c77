"""Mask planning: which keys a block of query rows sees, from global token columns alone.

Key column c is visible to query column q iff c <= q and q - c < window (sliding layers); padding
is applied on top by the kernels. Everything here works on column vectors and ranges (never a
(Tq, Tk) integer temporary), so the kernels can pick, per block or tile, the fused kernel without
a mask ('all', the square 'causal' diagonal) and build an explicit mask only where it must.
"""

from __future__ import annotations

import torch


def runs(cols: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) index ranges over which `cols` (ascending, CPU) increases by exactly 1."""
    n = cols.numel()
    if n == 0:
        return []
    breaks = (torch.nonzero(cols[1:] - cols[:-1] != 1).flatten() + 1).tolist()
    edges = [0, *breaks, n]
    return list(zip(edges[:-1], edges[1:]))


def visible(q_cols, k_cols, window, device):
    """(Tq, Tk) bool for one tile. Only comparisons of column vectors: no (Tq, Tk) integer temporary."""
    qc = q_cols.to(device).unsqueeze(-1)
    kc = k_cols.to(device).unsqueeze(0)
    vis = kc <= qc
    if window is not None:
        vis &= kc > qc - window
    return vis


def classify(q_cols, k_cols, window):
    """'none', 'all', 'causal' (square diagonal) or 'mask', from column ranges alone."""
    q_lo, q_hi = int(q_cols[0]), int(q_cols[-1])
    k_lo, k_hi = int(k_cols[0]), int(k_cols[-1])
    if k_lo > q_hi or (window is not None and q_lo - k_hi >= window):
        return "none"
    if k_hi <= q_lo and (window is None or q_hi - k_lo < window):
        return "all"
    contiguous = q_hi - q_lo + 1 == q_cols.numel() and k_hi - k_lo + 1 == k_cols.numel()
    if contiguous and q_lo == k_lo and q_hi == k_hi and (window is None or q_hi - q_lo < window):
        return "causal"
    return "mask"


def key_segments(q_cols, k_cols, window):
    """[a, b) key-index ranges of the keys that rows q_cols (ascending) can see, cut at the column edges
    where visibility changes: q_lo - window + 1 (band: some rows), q_hi - window + 1 (keys every row sees,
    up to q_lo), q_lo (the causal diagonal), q_hi + 1. k_cols: ascending."""
    q_lo, q_hi = int(q_cols[0]), int(q_cols[-1])
    edges = [q_lo, q_hi + 1]
    if window is not None:
        edges = [q_lo - window + 1, min(q_hi - window + 1, q_lo), *edges]
    idx = torch.searchsorted(k_cols, torch.tensor(edges, dtype=k_cols.dtype)).tolist()
    if window is None:
        idx = [0, *idx]
    return [(a, b) for a, b in zip(idx[:-1], idx[1:]) if b > a]
