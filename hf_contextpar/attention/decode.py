"""Sharded-KV decode (vLLM DCP, CSPS broadcast-Q decode).

Every rank computes the same new token(s); the K/V of each is stored on one rank. Each rank
attends the replicated queries to its own slice, then one all-gather of (out, LSE) and a merge
in rank order give every rank bit-identical attention outputs, hence identical logits. The merged
LSE is not returned (nothing after the last merge of a layer reads it), so attention sinks enter
that merge here.
"""

from __future__ import annotations

from .kernels import acc_dtype, attend
from .merge import merge_packed, merge_packed_out, pack_partial


def replicated_decode(step, q, kv_local, **attn):
    rank = step.comm.rank
    k, v = step.unpack(kv_local, rank)
    kind = step.block_kind(rank, attn.get("window"))  # once per forward: every layer's columns are the same
    res = attend(q, k, v, step.q_cols, step.kv_cols[rank], key_valid=step.key_valid(rank), kind=kind, **attn)
    packed = pack_partial(res, step.out_shape(q), acc_dtype(q.dtype), q.device)
    if step.dcp is not None or step.wants_lse:  # DCP (entries.py too) merges more afterwards: it needs the LSE
        return merge_packed(step.comm.all_gather(packed))
    return merge_packed_out(step.comm.all_gather(packed), step.sinks), None  # no caller reads a decode LSE
