"""Ring pass-Q (Meta CP paper, Alg. 3).

K/V stay where they are cached; each rank's query block travels N-1 hops around the ring and is
attended against every rank's local K/V (the next block in flight while one is computed). The
partial (out, LSE) for rank j's queries end up spread over all ranks, so one All2All sends them
home, where they merge in rank order. Cheaper than pass-KV when the new tokens are few next to
the cache: T/(T+P) <= 2 N_KV / N_H (CP paper Eq. 1); see `planner`.
"""

from __future__ import annotations

import torch

from .kernels import acc_dtype, attend
from .merge import merge_packed, pack_partial


def pass_q(step, q, block_shape, attend_block):
    """The pass-Q skeleton shared with batched decode: this rank's query block travels the ring,
    `attend_block(src, block)` attends rank src's block here, and one All2All brings every partial
    home for the merge. block_shape(r): the shape of rank r's query block."""
    comm, rank, world = step.comm, step.comm.rank, step.comm.world
    partial = [None] * world
    block, src = q.contiguous(), rank
    for hop in range(world):
        pending = None
        if hop < world - 1:
            nxt = (rank - hop - 1) % world
            pending = comm.send_recv(block, block_shape(nxt))
        partial[src] = pack_partial(attend_block(src, block), step.out_shape(block), acc_dtype(q.dtype), q.device)
        if pending is not None:
            block, src = pending.wait(), nxt
    b, h, t, d = step.out_shape(q)
    home = comm.all_to_all(partial, [(b, h, t, d + 1)] * world)
    return merge_packed(torch.stack(home))


def ring_pass_q(step, q, kv_local, **attn):
    rank = step.comm.rank
    k, v = step.unpack(kv_local, rank)
    b, h, _, d = q.shape
    key_valid = step.key_valid(rank)
    return pass_q(
        step,
        q,
        lambda r: (b, h, step.q_cols_all[r].numel(), d),
        lambda src, block: attend(block, k, v, step.q_cols_all[src], step.kv_cols[rank], key_valid=key_valid, **attn),
    )
