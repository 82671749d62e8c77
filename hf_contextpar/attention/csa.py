"""CSPS's communication-efficient sparse attention (CSA): approximate, opt in (sparse/csa.py defines it).

Contiguous partitions (the policy's: balanced by default; each rank stores its own, since the K/V that travel
are pruned and cannot level the cache) in topology order, so every earlier partition is wholly in a query's past and
lies on a nearer or equally near rank the closer it is. The K/V pass one way down a chain, as
KV-Runahead's do (rank i receives from i-1 the blocks of ranks i-1, ..., 0, nearest first, and forwards
each with its own to i+1), but pruned: a block travels as its keys sorted by importance (the previous
attention layer's order, `csa.importance_order`) and cut to what the next rank's level keeps. The kept
sets are nested, so forwarding to a farther level is a shorter prefix of the same buffer: dropped tokens
cost neither bytes nor FLOPs, and KV heads are never repeated. Every message size follows from the
replicated padding and settings, and whether a layer prunes from its index alone (`SparseRun.prunes`), so the
receives of the next full-attention layer are posted when this one's attention is done, as KV-Runahead posts
them (once an earlier forward has shown that layer's block geometry). A received block is attended whole (all its
keys are in the past), the slots beyond a sequence's kept count masked; partials merge by LSE. The rank's own
block is attended exactly (causal), and its last `observe` query rows rank its keys for the next full-attention
layer, where that layer prunes (no other reads the order).

A sliding-window layer runs exact: its queries see only the window - 1 keys before their partition, which CSA
keeps whole, so each rank receives just those (`_sliding`), not every earlier block. The cache keeps every token
(this rank's partition), so decode and later turns run exact.
"""

from __future__ import annotations

import torch

from ..cache.blocks import block_shape
from ..errors import UnsupportedModelError
from ..sparse.csa import importance_order, kept_counts, observed_rows
from .kernels import attend
from .merge import Accumulator
from .ring_pass_kv import ring_pass_kv


def _kept(step, src: int, dst: int, exact: bool, layer: int | None = None) -> tuple:
    """(slots, valid) of rank src's block as it travels to rank dst: how many slots, and (B, slots) bool of the
    slots each sequence keeps (None: all of them). Exact layers send the block as stored, padding masked. A pure
    function of the plan and the settings (a fresh prefill: every full-attention layer holds the same columns),
    so it is worked out once per forward."""
    key = ("csa_kept", src, dst, exact)
    if key not in step.state:
        size, valid = step.kv_size(src, layer), step.key_valid(src)
        if exact:
            step.state[key] = size, valid
        else:
            csa = step.sparse.csa
            batch = step.padding.shape[0] if step.padding is not None else 1
            counts = kept_counts(valid, size, batch, csa.fraction(csa.levels(src, dst)))
            slots = int(counts.max()) if counts.numel() else 0
            keep = torch.arange(slots).view(1, -1) < counts.view(-1, 1)
            step.state[key] = slots, None if bool(keep.all()) else keep
    return step.state[key]


def _prefix(block: torch.Tensor, slots: int) -> torch.Tensor:
    return block if block.shape[3] == slots else block[:, :, :, :slots].contiguous()


def _own_block(step, kv_local, order, exact: bool):
    """This rank's block as it leaves for the next rank: whole at an exact layer, else only the keys that rank's
    level keeps, gathered in importance order (nothing more is copied)."""
    slots = _kept(step, step.comm.rank, step.comm.rank + 1, exact)[0]
    if exact:
        return _prefix(kv_local, slots)
    kept = order[..., :slots]  # (B, Hkv, slots)
    return kv_local.gather(3, kept[None, ..., None].expand(kv_local.shape[0], -1, -1, -1, kv_local.shape[4]))


def _post_receives(step, layer: int, like: torch.Tensor) -> list:
    """Post the receives of full-attention layer `layer`'s blocks from rank - 1 (sources rank-1, ..., 0, nearest
    first), each at the slots this rank's level keeps of it there. like: a block of this forward (batch, dtype)."""
    rank, (two, heads, dim) = step.comm.rank, step.kv_shapes[layer]
    exact = not step.sparse.prunes(layer)
    shapes = [(two, like.shape[1], heads, _kept(step, src, rank, exact, layer)[0], dim) for src in range(rank)]
    return [(src, step.comm.recv_prev(shapes[src], like.dtype, like.device)) for src in range(rank - 1, -1, -1)]


def _post_ahead(step, like: torch.Tensor) -> None:
    """The next layer's receives, posted now (as KV-Runahead posts them): where it is a full-attention layer whose
    geometry an earlier forward showed and which passes no recurrent state down the same ring (messages between two
    ranks match in posting order)."""
    nxt = step.layer + 1
    if step.comm.rank > 0 and nxt in step.sparse.attending and nxt in step.kv_shapes and not step.chained_at(nxt):
        step.state[("csa_recv", nxt)] = _post_receives(step, nxt, like)


def csa(step, q, kv_local, *, scale, window=None, softcap=None):
    if step.sinks is not None or not isinstance(window, (int, type(None))):
        raise UnsupportedModelError("sparse=CSA(...) prunes full causal attention layers: no chunks or sinks.")
    if window is not None:  # a sliding layer sees only its near past, which CSA keeps whole: exact
        acc, sends = _sliding(step, q, kv_local, scale=scale, window=window, softcap=softcap)
    else:
        acc, sends = _full(step, q, kv_local, scale=scale, softcap=softcap)
    _post_ahead(step, kv_local)
    for s in sends:  # the blocks must stay untouched until they are out
        s.wait()
    return acc.result() or (None, None)


def _full(step, q, kv_local, *, scale, softcap):
    """A full-attention layer: its own block causally, then each earlier rank's block as it lands (forwarded first),
    pruned to this rank's level where the layer prunes. Returns (the accumulator, the sends to wait for)."""
    comm, rank, world = step.comm, step.comm.rank, step.comm.world
    order = step.state.pop("csa_order", None)  # the previous attention layer's importance order of our keys
    exact = not step.sparse.prunes(step.layer)
    if not exact and order is None:
        raise RuntimeError(f"CSA: layer {step.layer} prunes, but no earlier full-attention layer ranked its keys.")
    pending = step.state.pop(("csa_recv", step.layer), None)
    if pending is None:
        pending = _post_receives(step, step.layer, kv_local)
    sends = [] if rank == world - 1 else [comm.send_next(_own_block(step, kv_local, order, exact))]
    acc = Accumulator(q.shape[2])
    k, v = step.unpack(kv_local, rank)
    attend(
        q, k, v, step.q_cols, step.kv_cols[rank], key_valid=step.key_valid(rank), scale=scale, softcap=softcap, into=acc
    )
    if step.sparse.ranks_for(step.layer):
        rows = observed_rows(q.shape[2], step.sparse.csa.observe)
        valid = step.key_valid(None)
        step.state["csa_order"] = importance_order(
            q[:, :, rows],
            k,
            step.q_cols[rows],
            step.kv_cols[rank],
            None if valid is None else valid[:, rows],
            step.key_valid(rank),
            scale,
            softcap,
        )
    for src, recv in pending:
        block = recv.wait()
        if rank < world - 1:
            sends.append(comm.send_next(_prefix(block, _kept(step, src, rank + 1, exact)[0])))
        slots, keep = _kept(step, src, rank, exact)
        k, v = step.unpack(block, src)
        cols = step.kv_cols[src][:slots]  # all earlier than our queries: every slot is visible but for `keep`
        attend(q, k, v, step.q_cols, cols, key_valid=keep, scale=scale, softcap=softcap, into=acc)
    return acc, sends


def _spans(step) -> list | None:
    """Every rank's [start, end) columns where the partitions tile one range in rank order (a fresh prefill), else None."""
    cols, spans = step.kv_cols, []
    for c in cols:
        if c.dim() != 1 or c.numel() == 0 or int(c[-1]) - int(c[0]) + 1 != c.numel():
            return None
        spans.append((int(c[0]), int(c[-1]) + 1))
    return spans if all(a[1] == b[0] for a, b in zip(spans, spans[1:])) else None


def _sliding(step, q, kv_local, *, scale, window, softcap):
    """A sliding-window layer, exact: rank d's queries see, before their partition, only its last window - 1
    columns (the tail). Rank d - 1 sends d that tail: the end of its own block, or, where its block is shorter, the
    end of the tail it received with its block. One small message per hop instead of ring pass-KV's every block.
    Returns (the accumulator, the sends to wait for)."""
    spans = _spans(step) if step.dcp is None else None
    if spans is None:  # not one range of contiguous partitions: every block around the ring
        acc = Accumulator(q.shape[2])
        out, lse = ring_pass_kv(step, q, kv_local, scale=scale, window=window, softcap=softcap)
        acc.add(out, lse)
        return acc, []
    comm, rank, world = step.comm, step.comm.rank, step.comm.world
    tail = [min(window - 1, a - spans[0][0]) for a, _ in spans]  # columns rank d needs from before its partition
    recv = comm.recv_prev(block_shape(kv_local, tail[rank]), kv_local.dtype, kv_local.device) if tail[rank] else None
    out = tail[rank + 1] if rank < world - 1 else 0
    own = kv_local.shape[3]
    sends = [comm.send_next(kv_local[:, :, :, own - out :].contiguous())] if 0 < out <= own else []
    acc = Accumulator(q.shape[2])
    attn = dict(scale=scale, window=window, softcap=softcap, into=acc)
    k, v = step.unpack(kv_local, rank)
    attend(q, k, v, step.q_cols, step.kv_cols[rank], key_valid=step.key_valid(rank), **attn)
    if recv is not None:
        block = recv.wait()
        if out > own:  # our block is shorter than the next rank's tail: it goes on with the end of ours
            sends.append(comm.send_next(torch.cat([block, kv_local], dim=3)[:, :, :, -out:].contiguous()))
        start = spans[rank][0]
        cols = torch.arange(start - tail[rank], start)
        valid = step.padding[:, start - tail[rank] : start] if step.padding is not None else None
        rows = min(q.shape[2], window - 1)  # only the first window - 1 rows reach back before the partition
        k, v = step.unpack(block, rank - 1)
        attend(q[:, :, :rows], k, v, step.q_cols[:rows], cols, key_valid=valid, **attn)
    return acc, sends
