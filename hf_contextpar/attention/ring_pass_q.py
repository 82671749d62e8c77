"""Ring pass-Q (Meta CP paper, Alg. 3).

K/V stay where they are cached; each rank's query block travels N-1 hops around the ring and is
attended against every rank's local K/V (the next block in flight while one is computed). The
partial (out, LSE) for rank j's queries end up spread over all ranks, so one All2All sends them
home, where they merge in rank order. Cheaper than pass-KV when the new tokens are few next to
the cache: T/(T+P) <= 2 N_KV / N_H (CP paper Eq. 1); see `planner`.
"""

from __future__ import annotations

import torch

from ..kernels import acc_dtype, attend
from ..merge import merge_packed, pack_partial


def ring_pass_q(step, q, kv_local, **attn):
    comm, rank, world = step.comm, step.comm.rank, step.comm.world
    k, v = kv_local[:, 0].permute(1, 2, 0, 3), kv_local[:, 1].permute(1, 2, 0, 3)
    b, h, _, d = q.shape
    partial = [None] * world
    block, src = q.contiguous(), rank
    for hop in range(world):
        pending = None
        if hop < world - 1:
            nxt = (rank - hop - 1) % world
            pending = comm.ring_shift(block, (b, h, step.q_cols_all[nxt].numel(), d), block.dtype, block.device)
        res = attend(block, k, v, step.q_cols_all[src], step.kv_cols[rank], key_valid=step.key_valid(rank), **attn)
        partial[src] = pack_partial(res, block.shape, acc_dtype(q.dtype), q.device)
        if pending is not None:
            block, src = pending.wait(), nxt
    home = comm.all_to_all(partial, [(b, h, q.shape[2], d + 1)] * world)
    return merge_packed(torch.stack(home))
