"""All-gather KV (KV-Runahead's TSP baseline, Llama 3's and vLLM PCP's prefill).

Queries stay head-tail sharded. Each layer gathers every rank's K/V for this forward (cached
and new, exactly as stored: KV heads only, exact sizes, so nothing is padded): one broadcast per
rank, all posted at once. The local queries attend to our own block while the others arrive,
then to each one as it lands, merging by LSE. The gathered copies live only for this layer's
attention. Simple and exact; unlike the ring, memory peaks at the whole layer's K/V.
"""

from __future__ import annotations

from ..cache.blocks import block_shape
from .kernels import attend
from .merge import Accumulator


def allgather_kv(step, q, kv_local, **attn):
    comm, rank, world = step.comm, step.comm.rank, step.comm.world
    blocks = comm.broadcast_blocks(kv_local, [block_shape(kv_local, step.kv_size(r)) for r in range(world)])
    acc = Accumulator(q.shape[2])
    for src in [(rank + i) % world for i in range(world)]:  # our own block first, while the others land
        block = blocks[src].wait()
        k, v = step.unpack(block, src)
        attend(q, k, v, step.q_cols, step.kv_cols[src], key_valid=step.key_valid(src), **attn, into=acc)
        step.received(block, src)  # the cache keeps what this rank commits of it (rebalancing)
        blocks[src] = None  # drop each gathered block as soon as it is attended
    return acc.result() or (None, None)
