"""All-gather KV (KV-Runahead's TSP baseline, Llama 3's and vLLM PCP's prefill).

Queries stay head-tail sharded. Each layer gathers every rank's K/V for this forward (cached
and new, exactly as stored: KV heads only, exact sizes, so nothing is padded), attends the
local queries to each rank's block and merges by LSE in rank order. The gathered copy lives
only for this layer's attention. Simple and exact; unlike the ring, memory peaks at the whole
layer's K/V and nothing overlaps the collective.
"""

from __future__ import annotations

from ..kernels import attend
from ..merge import Accumulator


def allgather_kv(step, q, kv_local, **attn):
    comm, rank, world = step.comm, step.comm.rank, step.comm.world
    empty = kv_local[:0]
    sizes = [step.kv_cols[r].numel() for r in range(world)]
    blocks = comm.all_to_all([empty if r == rank else kv_local for r in range(world)],
                             [(0 if r == rank else sizes[r], *kv_local.shape[1:]) for r in range(world)])
    blocks[rank] = kv_local
    acc = Accumulator()
    for src, block in enumerate(blocks):
        k, v = block[:, 0].permute(1, 2, 0, 3), block[:, 1].permute(1, 2, 0, 3)
        res = attend(q, k, v, step.q_cols, step.kv_cols[src], key_valid=step.key_valid(src), **attn)
        if res is not None:
            acc.add(*res)
    return acc.out, acc.lse
