"""CSPS's communication-efficient sparse attention (CSA): approximate, opt in (sparse/csa.py defines it).

Contiguous partitions (the policy's: balanced by default; each rank stores its own, since the K/V that travel
are pruned and cannot level the cache) in topology order, so every earlier partition is wholly in a query's past and
lies on a nearer or equally near rank the closer it is. The K/V pass one way down a chain, as
KV-Runahead's do (rank i receives from i-1 the blocks of ranks i-1, ..., 0, nearest first, and forwards
each with its own to i+1), but pruned: a block travels as its keys sorted by importance (the previous
attention layer's order, `csa.importance_order`) and cut to what the next rank's level keeps. The kept
sets are nested, so forwarding to a farther level is a shorter prefix of the same buffer: dropped tokens
cost neither bytes nor FLOPs, and KV heads are never repeated. Every message size follows from the
replicated padding and settings. A received block is attended whole (all its keys are in the past), the
slots beyond a sequence's kept count masked; partials merge by LSE. The rank's own block is attended
exactly (causal), and its last `observe` query rows rank its keys for the next layer.

A sliding-window layer runs ring pass-KV, exact. The cache keeps every token (this rank's partition), so
decode and later turns run exact.
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedModelError
from ..sparse.csa import importance_order, kept_counts, observed_rows
from .kernels import attend
from .merge import Accumulator
from .ring_pass_kv import ring_pass_kv


def _kept(step, src: int, dst: int, exact: bool) -> tuple:
    """(slots, valid) of rank src's block as it travels to rank dst: how many slots, and (B, slots) bool of the
    slots each sequence keeps (None: all of them). Exact layers send the block as stored, padding masked."""
    size, valid = step.kv_size(src), step.key_valid(src)
    if exact:
        return size, valid
    csa = step.sparse.csa
    batch = step.padding.shape[0] if step.padding is not None else 1
    counts = kept_counts(valid, size, batch, csa.fraction(csa.levels(src, dst)))
    slots = int(counts.max()) if counts.numel() else 0
    keep = torch.arange(slots).view(1, -1) < counts.view(-1, 1)
    return slots, None if bool(keep.all()) else keep


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


def csa(step, q, kv_local, *, scale, window=None, softcap=None):
    if step.sinks is not None or not isinstance(window, (int, type(None))):
        raise UnsupportedModelError("sparse=CSA(...) prunes full causal attention layers: no chunks or sinks.")
    if window is not None:  # a sliding layer sees only its near past, which CSA keeps whole: exact
        return ring_pass_kv(step, q, kv_local, scale=scale, window=window, softcap=softcap)
    comm, rank, world = step.comm, step.comm.rank, step.comm.world
    order = step.state.pop("csa_order", None)  # the previous attention layer's importance order of our keys
    exact = order is None or step.layer in step.sparse.exact
    two, batch, heads, dim = kv_local.shape[0], kv_local.shape[1], kv_local.shape[2], kv_local.shape[4]
    sources = range(rank - 1, -1, -1)  # what rank-1 sends us, nearest first
    pending = [
        (
            src,
            comm.recv_prev((two, batch, heads, _kept(step, src, rank, exact)[0], dim), kv_local.dtype, kv_local.device),
        )
        for src in sources
    ]
    sends = [] if rank == world - 1 else [comm.send_next(_own_block(step, kv_local, order, exact))]
    acc = Accumulator(q.shape[2])
    k, v = step.unpack(kv_local, rank)
    attend(
        q, k, v, step.q_cols, step.kv_cols[rank], key_valid=step.key_valid(rank), scale=scale, softcap=softcap, into=acc
    )
    if step.layer != step.sparse.last:
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
    for s in sends:  # the blocks must stay untouched until they are out
        s.wait()
    return acc.result() or (None, None)
