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


def merge_into(out_a, lse_a, out_b, lse_b) -> None:
    """`merge_pair` written into (out_a, lse_a) in place: the same arithmetic, no new (T, D) tensor."""
    lse = torch.logaddexp(lse_a, lse_b)
    ref = _safe(lse)
    out_a.mul_(torch.exp(lse_a - ref).unsqueeze(-1))
    out_a.add_(out_b * torch.exp(lse_b - ref).unsqueeze(-1))
    lse_a.copy_(lse)


def merge_stacked(outs: torch.Tensor, lses: torch.Tensor):
    """Merge partials stacked on dim 0 (outs: (S, ..., T, D), lses: (S, ..., T)) in one fixed order.

    Relative to the largest LSE m: weights w_s = exp(L_s - m), O = sum_s w_s O_s / sum_s w_s,
    L = m + log sum_s w_s. Decode merges a few one-token partials per layer, where each op's
    overhead is the cost, so this takes as few ops as it can (no logsumexp, whose own steps redo the
    max). The largest partial's weight is 1, so the sum is >= 1 unless no partial saw a key (every
    L_s = -inf): then m counts as 0, every weight is 0, and the row stays (0, -inf)."""
    top = lses.amax(dim=0)
    top = top.masked_fill(torch.isneginf(top), 0.0)
    weights = torch.exp(lses - top)
    total = weights.sum(dim=0)
    out = (outs * weights.unsqueeze(-1)).sum(dim=0) / total.clamp_min(1.0).unsqueeze(-1)
    return out, top + torch.log(total)


class Accumulator:
    """Running merge of partials into the rows of one query block (the ring's inner loop).

    A partial may cover only some of the rows (`add(out, lse, start)`): with head-tail shards a key
    block is often visible to one of a rank's two query chunks only. Rows a partial reaches first
    take it as it is, rows that already hold one merge with it in place, and rows no partial
    reached read (0, -inf) only at the end; so a merge touches just the rows a block contributes
    to, and a block that contributes nothing costs nothing. Merging a row with (0, -inf) would
    leave it unchanged, so the result is the same as merging whole blocks.

    `rows`: the block's row count (None: taken from the first partial, which must then cover every
    row). `out` and `lse` hold the merged result once every row has been reached (`result()`
    finishes the rest).
    """

    def __init__(self, rows: int | None = None):
        self.rows = rows
        self.out = None
        self.lse = None
        self._reached: list[tuple[int, int]] = []  # sorted disjoint [a, b) row ranges holding a partial
        self._owned = False  # out/lse are our own buffers (else the first partial's tensors: never written)

    def add(self, out, lse, start: int = 0):
        if out is None:
            return
        end = start + out.shape[-2]
        if self.rows is None:
            self.rows = end
        if self.out is None and (start, end) == (0, self.rows):  # the usual first partial: keep it, no copy
            self.out, self.lse, self._reached = out, lse, [(0, end)]
            return
        if self.out is None:
            self.out = out.new_empty((*out.shape[:-2], self.rows, out.shape[-1]))
            self.lse = lse.new_empty((*lse.shape[:-1], self.rows))
            self._owned = True
        for a, b, seen in self._split(start, end):
            o, lse_b = out[..., a - start : b - start, :], lse[..., a - start : b - start]
            if not seen:
                self.out[..., a:b, :], self.lse[..., a:b] = o, lse_b
            elif (a, b) == (0, self.rows) and not self._owned:  # a whole-block merge: a new result
                self.out, self.lse = merge_pair(self.out, self.lse, o, lse_b)
                self._owned = True
            else:
                self._own()
                merge_into(self.out[..., a:b, :], self.lse[..., a:b], o, lse_b)
        self._reached = _union(self._reached, start, end)

    def result(self):
        """(out, lse) over every row, (0, -inf) where no partial reached; None if none did."""
        if self.out is None:
            return None
        edges = [0, *(x for r in self._reached for x in r), self.rows]
        for a, b in zip(edges[::2], edges[1::2]):
            if b > a:
                self.out[..., a:b, :], self.lse[..., a:b] = 0.0, -float("inf")
        self._reached = [(0, self.rows)]
        return self.out, self.lse

    def _own(self):
        if not self._owned:
            self.out, self.lse, self._owned = self.out.clone(), self.lse.clone(), True

    def _split(self, start, end):
        """[start, end) cut into pieces (a, b, already reached?)."""
        pieces, at = [], start
        for a, b in self._reached:
            a, b = max(a, start), min(b, end)
            if a >= b:
                continue
            if a > at:
                pieces.append((at, a, False))
            pieces.append((a, b, True))
            at = b
        if at < end:
            pieces.append((at, end, False))
        return pieces


def _union(ranges, start, end):
    """Sorted disjoint ranges with [start, end) added (adjacent ones joined)."""
    out = []
    for a, b in sorted([*ranges, (start, end)]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def pack_partial(res, shape, dtype, device):
    """(out, lse) -> one (B, H, T, D+1) tensor for a collective; None (nothing visible) -> zeros / -inf."""
    b, h, t, d = shape
    o, lse = res if res is not None else (None, None)
    if (
        o is not None
        and o.shape == shape
        and lse.shape == shape[:-1]
        and o.dtype == lse.dtype == dtype
        and o.device == device
    ):
        return torch.cat([o, lse.unsqueeze(-1)], dim=-1)  # the same in one op (a decode step's pack: 3 us, not 19)
    packed = torch.empty((b, h, t, d + 1), dtype=dtype, device=device)
    if res is None:
        packed[..., :d], packed[..., d] = 0.0, -float("inf")
    else:
        packed[..., :d], packed[..., d] = res[0][..., :d], res[1]  # a padded output's zero columns stay home
    return packed


def merge_packed(stacked):
    """Merge partials packed by `pack_partial` and stacked on dim 0, in that (rank) order."""
    return merge_stacked(stacked[..., :-1], stacked[..., -1])


def merge_packed_out(stacked, sink=None):
    """`merge_packed`'s output alone, for decode, whose caller needs no LSE: the weights exp(L_s - L)
    are a softmax over dim 0, one op, so a layer's merge is four ops instead of `merge_stacked`'s
    dozen (each op's overhead is the cost for one token). A row no partial saw (every L_s = -inf)
    gets NaN weights from the softmax: they become 0, so the row stays 0, as in `merge_stacked`.
    `sink` (H,) or (B, H, T) (`sink_logits`): attention sinks enter as one more partial, (0, sink), in the same
    softmax."""
    lses = stacked[..., -1:]  # (S, B, H, T, 1): the weights broadcast over the output columns as they are
    if sink is not None:
        lses = torch.cat([lses, sink_logits(sink, lses[0, ..., 0])[None, ..., None]])
    weights = torch.softmax(lses, dim=0).nan_to_num_(0.0)
    if sink is not None:  # the sink's weight has no output
        weights = weights[: stacked.shape[0]]
    return (stacked[..., :-1] * weights).sum(dim=0)


def with_sink(out, lse, sink):
    """Attention with sinks (gpt-oss: a learned per-head logit in the softmax denominator, with no
    value) from the merged attention over every key: the sink is one more partial, (0, s), merged
    once, so O * exp(L - logaddexp(L, s)) = O * sigmoid(L - s). out (B, H, T, D), lse (B, H, T),
    sink (H,) or (B, H, T) (`sink_logits`). A row that saw no key (L = -inf, O = 0) stays 0, as with the sink alone."""
    weight = torch.sigmoid(lse - sink_logits(sink, lse))
    return out * weight.unsqueeze(-1).to(out.dtype)


def sink_logits(sink, lse):
    """The sink logits beside an LSE (B, H, T): learned per head (H,), GPT-OSS's, or computed per query token and
    head (B, H, T), Inkling 2's (from each query's hidden state: they belong to this rank's query rows)."""
    sink = sink.to(lse.dtype)
    return (sink.view(1, -1, 1) if sink.dim() == 1 else sink).expand_as(lse)
