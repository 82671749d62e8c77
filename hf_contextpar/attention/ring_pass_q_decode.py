"""Batched ring pass-Q decode (Meta CP paper 3.6, Alg. 4).

With B >= N sequences decoding together, step s gives sequence b to rank (b + s) mod N: each rank
runs the whole model on about B/N tokens instead of all B, and stores their K/V, so every
sequence's decode tokens rotate over the ranks and the shards stay level. The query block (one
token per sequence) travels the ring; each rank attends it to its own K/V of those sequences;
one All2All brings the partial outputs home for the LSE merge. A rank's rows are the strided
slice start::N, so selecting them from the cache is a view, not a copy.
"""

from __future__ import annotations

import torch

from ..kernels import acc_dtype, attend
from ..merge import merge_packed, pack_partial


def ring_pass_q_decode(step, q, kv_local, **attn):
    comm, rank, world = step.comm, step.comm.rank, step.comm.world
    k_all, v_all = kv_local[:, 0].permute(1, 2, 0, 3), kv_local[:, 1].permute(1, 2, 0, 3)
    cols = step.kv_cols[rank]
    _, h, t, d = q.shape
    partial = [None] * world
    block, src = q.contiguous(), rank
    for hop in range(world):
        pending = None
        if hop < world - 1:
            nxt = (rank - hop - 1) % world
            pending = comm.ring_shift(block, (step.batch_size(nxt), h, t, d), block.dtype, block.device)
        rows = step.batch_rows[src]
        k_cols = cols[rows] if cols.dim() == 2 else cols
        res = attend(block, k_all[rows], v_all[rows], step.q_cols, k_cols, key_valid=step.key_valid(rank, rows), **attn)
        partial[src] = pack_partial(res, block.shape, acc_dtype(q.dtype), q.device)
        if pending is not None:
            block, src = pending.wait(), nxt
    home = comm.all_to_all(partial, [(q.shape[0], h, t, d + 1)] * world)
    return merge_packed(torch.stack(home))
