"""Ring pass-KV (Meta CP paper, Alg. 2).

Queries stay. Each rank's K/V block travels N-1 hops around the ring; while one block is
attended the next is already in flight (async send/recv posted before the compute). Blocks go
exactly as stored: the model's KV heads (never repeated for GQA) in one packed buffer. Message
sizes are known to every rank from the replicated shard layout, so there is no padding and no
size exchange. Partials merge by LSE in the accumulation dtype.
"""

from __future__ import annotations

from ..cache.blocks import block_shape
from .kernels import attend
from .merge import Accumulator


def ring_pass_kv(step, q, kv_local, **attn):
    comm, rank, world = step.comm, step.comm.rank, step.comm.world
    acc = Accumulator(q.shape[2])
    block, src = kv_local, rank
    for hop in range(world):
        pending = None
        if hop < world - 1:
            nxt = (rank - hop - 1) % world
            pending = comm.send_recv(block, block_shape(block, step.kv_size(nxt)))
        k, v = step.unpack(block, src)
        attend(q, k, v, step.q_cols, step.kv_cols[src], key_valid=step.key_valid(src), **attn, into=acc)
        step.received(block, src)  # the cache keeps what this rank commits of it (rebalancing)
        if pending is not None:
            block, src = pending.wait(), nxt
    return acc.result() or (None, None)
