"""Mask planning: which keys a block of query rows sees, from global token columns alone.

Key column c is visible to query column q iff lo(q) <= c <= q, where lo(q) is 0 (full attention),
q - window + 1 (a sliding window of `window` tokens), or the first column of q's chunk (`Chunked`,
Llama 4's chunked attention); lo never decreases with q. Padding is applied on top by the kernels.
Everything here works on column vectors and ranges (never a (Tq, Tk) integer temporary), so the
kernels can pick, per block or tile, the fused kernel without a mask ('all', the square 'causal'
diagonal) and build an explicit mask only where it must.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class Chunked:
    """Chunked attention: a query sees the keys of its own chunk of `size` columns only. transformers
    counts each sequence's chunks from its first real token: `offsets` (B,), its left-padding count."""

    size: int
    offsets: torch.Tensor  # (B,) long, on the CPU

    def rows(self, rows) -> Chunked:
        """The same chunks for a subset of the sequences (rows: an index or slice of the batch)."""
        return Chunked(self.size, self.offsets[rows])

    def lo(self, q):
        """The first column q's chunk starts at, per sequence: (B,) for a column, (B, ...) for a tensor of them."""
        offsets = self.offsets.view(-1, *([1] * torch.as_tensor(q).dim()))
        return q - (q - offsets.to(torch.as_tensor(q).device)) % self.size


def for_rows(window, rows):
    """The mask of a subset of the batch's sequences (rows: an index or slice)."""
    return window.rows(rows) if isinstance(window, Chunked) else window


def span(window) -> int | None:
    """How many columns back a query can see at most: the window, a chunk's size, or None (unbounded)."""
    return window.size if isinstance(window, Chunked) else window


def _lo_range(q: int, window) -> tuple[int, int] | None:
    """(smallest, largest) lo(q) over the batch's sequences, or None for full attention."""
    if window is None:
        return None
    if isinstance(window, Chunked):
        lo = window.lo(q)
        return int(lo.min()), int(lo.max())
    return q - window + 1, q - window + 1


def runs(cols: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) index ranges over which `cols` (ascending, CPU) increases by exactly 1."""
    n = cols.numel()
    if n == 0:
        return []
    breaks = (torch.nonzero(cols[1:] - cols[:-1] != 1).flatten() + 1).tolist()
    edges = [0, *breaks, n]
    return list(zip(edges[:-1], edges[1:]))


def within(qc, kc, window):
    """The visibility rule itself, lo(q) <= c <= q, on broadcastable columns: qc (Tq, 1), kc (1, Tk) or
    (B, 1, Tk). Returns (Tq, Tk), or (B, Tq, Tk) where kc or chunks counted per sequence give a batch."""
    vis = kc <= qc
    if isinstance(window, Chunked):
        return vis & (kc >= window.lo(qc))
    if window is not None:
        return vis & (kc > qc - window)
    return vis


def visible(q_cols, k_cols, window, device):
    """(1, Tq, Tk) bool for one tile, (B, Tq, Tk) for chunks counted per sequence. Only comparisons of
    column vectors: no (Tq, Tk) integer temporary."""
    vis = within(q_cols.to(device).unsqueeze(-1), k_cols.to(device).unsqueeze(0), window)
    return vis if vis.dim() == 3 else vis.unsqueeze(0)


def classify(q_cols, k_cols, window):
    """'none', 'all', 'causal' (square diagonal) or 'mask', from column ranges alone (for every sequence)."""
    q_lo, q_hi = int(q_cols[0]), int(q_cols[-1])
    k_lo, k_hi = int(k_cols[0]), int(k_cols[-1])
    first, last = _lo_range(q_lo, window) or (0, 0), _lo_range(q_hi, window) or (0, 0)
    if k_lo > q_hi or k_hi < first[0]:  # lo never decreases: no row of any sequence reaches these keys
        return "none"
    if k_hi <= q_lo and k_lo >= last[1]:
        return "all"
    contiguous = q_hi - q_lo + 1 == q_cols.numel() and k_hi - k_lo + 1 == k_cols.numel()
    if contiguous and q_lo == k_lo and q_hi == k_hi and last[1] <= q_lo:
        return "causal"
    return "mask"


def key_segments(q_cols, k_cols, window):
    """[a, b) key-index ranges of the keys that rows q_cols (ascending) can see, cut at the column edges
    where visibility changes: the smallest lo(q_lo) (band: some rows), the largest lo(q_hi) (keys every
    row sees, up to q_lo), q_lo (the causal diagonal), q_hi + 1. k_cols: ascending."""
    q_lo, q_hi = int(q_cols[0]), int(q_cols[-1])
    edges = [q_lo, q_hi + 1]
    if window is not None:
        edges = [_lo_range(q_lo, window)[0], min(_lo_range(q_hi, window)[1], q_lo), *edges]
    idx = torch.searchsorted(k_cols, torch.tensor(edges, dtype=k_cols.dtype)).tolist()
    if window is None:
        idx = [0, *idx]
    return [(a, b) for a, b in zip(idx[:-1], idx[1:]) if b > a]


def ones_only(mask: torch.Tensor) -> bool:
    """Does a caller's 2D mask hold ones alone (nothing padded)? One op (aminmax): decode passes a mask as long as the
    sequence every step. A mask of other nonzero values is read as padding (all True), so the input check can take
    "no padding" for "ones alone" and hash such a mask by its width."""
    return mask.numel() == 0 or [t.item() for t in torch.aminmax(mask)] == [1, 1]
