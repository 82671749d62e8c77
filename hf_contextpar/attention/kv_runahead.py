"""KV-Runahead (Apple, arXiv 2405.05329, 4.1-4.3).

The prompt is cut into contiguous, possibly uneven partitions c_0..c_{N-1} (`sharding.
contiguous_plan`; by default balanced by measured work, `partitions.balanced`). Rank i needs the K/V of every earlier token, so the K/V travels one way down a
chain: rank i attends its queries to its own block (causal) while the prefix from rank i-1 is
still arriving, then to each prefix block as it lands, and forwards its own block and every
block it receives to rank i+1. Only point-to-point messages, no collective; total traffic is
(N-1)/2 C rows for even partitions, half an all-gather's (KVR Eqs. 4-7).

Rank i receives from rank i-1, in this order: i-1's own block, then what i-1 received
(blocks i-2, ..., 0). The receives of the next layer (l+1, or the one an earlier forward attended after l, as a
looped section's copies come: `_following`) are posted as soon as layer l's attention is done, so they are in
flight while this rank runs layer l's MLP and layer l+1's QKV projection: once an earlier forward has shown layer
l+1's block geometry (`Step.kv_shapes`, which the attention adapter records for every layer; layers may differ in
head size, as Gemma 4's do, and a receive of the wrong size would abort the group), and unless
layer l+1 also passes a recurrent state down the same ring (a hybrid layer's: messages between two
ranks match in posting order, and its state may go first).
Partial prefill over a non-empty cache runs ring pass-KV instead (see plan/forward.py). Uneven partitions
leave the earlier ranks more K/V; each rank keeps its even share of the columns instead, from its
own block and those it receives (`forward._rebalanced`: the algorithm hands each received block to
`Step.received`), so the cache ends 1/N.
"""

from __future__ import annotations

from .kernels import attend
from .merge import Accumulator


def _post_receives(step, layer, like, geometry):
    """Post receives for `layer`'s prefix blocks from rank-1 (sources rank-1, ..., 0). geometry: the
    layer's (packing, KV heads, head size) as `Step.kv_shapes` holds it; like: a block of this forward."""
    rank, (two, heads, dim), batch = step.comm.rank, geometry, like.shape[1]
    shapes = [(two, batch, heads, step.kv_size(src, layer), dim) for src in range(rank - 1, -1, -1)]
    step.state[("kvr_recv", layer)] = [
        (src, step.comm.recv_prev(shape, like.dtype, like.device))
        for src, shape in zip(range(rank - 1, -1, -1), shapes)
    ]


def _following(step) -> int | None:
    """The cache layer the forward attends after this one, as an earlier forward showed: `Step.kv_shapes` holds the
    layers in the order they first attended (l + 1 in most models; a looped section's copies come between its layers
    and the ones after it: Dory's). None before a forward has shown it (a layer counted without a cache is negative,
    never a layer that receives)."""
    order = [layer for layer in step.kv_shapes if layer >= 0]
    at = order.index(step.layer) if step.layer in order else len(order)
    return order[at + 1] if at + 1 < len(order) else None


def kv_runahead(step, q, kv_local, **attn):
    comm, rank, world = step.comm, step.comm.rank, step.comm.world
    last = rank == world - 1
    geometry = (kv_local.shape[0], kv_local.shape[2], kv_local.shape[4])
    pending = step.state.pop(("kvr_recv", step.layer), None)
    if pending is None:
        _post_receives(step, step.layer, kv_local, geometry)
        pending = step.state.pop(("kvr_recv", step.layer))
    sends = [] if last else [comm.send_next(kv_local)]
    acc = Accumulator(q.shape[2])
    blocks = [(rank, kv_local)]
    for i in range(len(pending) + 1):
        src, block = blocks[i] if i == 0 else (pending[i - 1][0], pending[i - 1][1].wait())
        if i > 0 and not last:
            sends.append(comm.send_next(block))
        if i > 0:
            step.received(block, src)  # the cache keeps what this rank commits of it (rebalancing)
        k, v = step.unpack(block, src)
        attend(q, k, v, step.q_cols, step.kv_cols[src], key_valid=step.key_valid(src), **attn, into=acc)
    following = _following(step)
    if following is not None and not step.chained_at(following):
        _post_receives(step, following, kv_local, step.kv_shapes[following])
    for s in sends:  # the blocks must stay untouched until they are out
        s.wait()
    return acc.result() or (None, None)
