"""Batched ring pass-Q decode (Meta CP paper 3.6, Alg. 4).

With B >= N sequences decoding together, step s gives sequence b to rank (b + s) mod N: each rank
runs the whole model on about B/N tokens instead of all B, and stores their K/V, so every
sequence's decode tokens rotate over the ranks and the shards stay even. The query block (one
token per sequence) travels the ring; each rank attends it to its own K/V of those sequences;
one All2All brings the partial outputs home for the LSE merge. A rank's rows are the strided
slice start::N, so selecting them from the cache is a view, not a copy.
"""

from __future__ import annotations

from .bias import rows_of
from .kernels import attend
from .masks import for_rows
from .ring_pass_q import pass_q


def ring_pass_q_decode(step, q, kv_local, **attn):
    rank = step.comm.rank
    k, v = step.unpack(kv_local, rank)
    cols = step.kv_cols[rank]
    _, h, t, d = q.shape

    def attend_block(src, block):
        rows = step.batch_rows[src]
        return attend(
            block,
            k[rows],
            v[rows],
            step.q_cols,
            cols[rows] if cols.dim() == 2 else cols,
            key_valid=step.key_valid(rank, rows),
            **{**attn, "window": for_rows(attn["window"], rows), "bias": rows_of(attn.get("bias"), rows)},
        )

    return pass_q(step, q, lambda r: (step.batch_size(r), h, t, d), attend_block)
