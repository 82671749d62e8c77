"""Ulysses-style head all-to-all (CSPS SP-NTP, 3.2.1; DeepSpeed-Ulysses).

Q and this forward's K/V arrive sharded by sequence. One all-to-all turns them into shards by
head: rank j gets every token of query heads [j H/N, (j+1) H/N) and of the matching KV heads
[j H_kv/N, (j+1) H_kv/N) (GQA groups stay whole; KV heads are sent as stored, never repeated).
With every column in hand, the rows are put in global order and one causal attention runs over
the whole sequence; a second all-to-all sends each rank its tokens' outputs for all heads.
Needs N to divide both H and H_kv: checked by apply_context_parallel on the heads a probe forward sees, and here
on the heads the attention gets (a family patch may hand it fewer: JetMoE's K/V before its repeat). No LSE merge: each head
sees all its keys at once, so no LSE is returned and attention sinks (of this rank's heads) are
applied here, before the outputs go back.
"""

from __future__ import annotations

import torch

from ..errors import HeadsNotDivisibleError


def ulysses(step, q, kv_local, **attn):
    from .kernels import attend
    from .merge import with_sink

    comm, world = step.comm, step.comm.world
    b, h, t, d = step.out_shape(q)  # d: the output's head size (the values')
    if h % world or kv_local.shape[2] % world:  # the same shapes on every rank: all raise, before any message
        raise HeadsNotDivisibleError(
            f"strategy='ulysses' splits attention heads over the {world} ranks, but layer {step.layer}'s attention "
            f"gets {h} query heads and {kv_local.shape[2]} KV heads, which {world} does not divide. Use "
            "strategy='ring_pass_kv' (or any other strategy), or a number of processes that divides both."
        )
    hq, hk = h // world, kv_local.shape[2] // world
    q_sizes = [c.numel() for c in step.q_cols_all]
    kv_sizes = [c.numel() for c in step.kv_cols]
    # sequence-sharded -> head-sharded
    qs = comm.all_to_all(
        [q[:, j * hq : (j + 1) * hq] for j in range(world)], [(b, hq, n, q.shape[-1]) for n in q_sizes]
    )
    kvs = comm.all_to_all(
        [kv_local[:, :, j * hk : (j + 1) * hk] for j in range(world)],
        [(kv_local.shape[0], b, hk, n, kv_local.shape[-1]) for n in kv_sizes],
    )
    q_cols, q_order = torch.cat(step.q_cols_all).sort()
    k_cols, k_order = torch.cat(step.kv_cols).sort()
    qh = torch.cat(qs, dim=2).index_select(2, q_order.to(q.device))
    k, v = step.unpack(torch.cat(kvs, dim=3).index_select(3, k_order.to(q.device)), None)
    key_valid = step.padding[:, k_cols.to(step.padding.device)] if step.padding is not None else None
    if attn.get("bias") is not None:  # a score bias per head (ALiBi): this rank's heads'
        attn = {**attn, "bias": attn["bias"].head_slice(comm.rank * hq, (comm.rank + 1) * hq)}
    res = attend(qh, k, v, q_cols, k_cols, key_valid=key_valid, **attn)
    if res is None:
        out = qh.new_zeros(step.out_shape(qh), dtype=torch.float32)
    else:
        out = res[0] if step.sinks is None else with_sink(*res, step.sinks[comm.rank * hq : (comm.rank + 1) * hq])
    # head-sharded -> sequence-sharded: rank i gets its own tokens back, for our heads
    out = out[..., :d].to(q.dtype).index_select(2, q_order.argsort().to(q.device))
    back = comm.all_to_all(list(out.split(q_sizes, dim=2)), [(b, hq, t, d)] * world)
    return torch.cat(back, dim=1), None
