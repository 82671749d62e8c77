"""Sharded-KV decode (vLLM DCP, CSPS broadcast-Q decode).

Every rank computes the same new token(s); the K/V of each is stored on one rank. Each rank
attends the replicated queries to its own slice, then one all-gather of (out, LSE) and a merge
in rank order give every rank bit-identical attention outputs, hence identical logits.
"""

from __future__ import annotations

import math

import torch

from ..kernels import acc_dtype, attend
from ..merge import merge_stacked


def sharded_kv_decode(step, q, kv_local, **attn):
    rank = step.comm.rank
    k, v = kv_local[:, 0].permute(1, 2, 0, 3), kv_local[:, 1].permute(1, 2, 0, 3)
    res = attend(q, k, v, step.q_cols, step.kv_cols[rank], key_valid=step.key_valid(rank), **attn)
    b, h, t, d = q.shape
    packed = torch.empty((b, h, t, d + 1), dtype=acc_dtype(q.dtype), device=q.device)
    if res is None:
        packed[..., :d] = 0.0
        packed[..., d] = -math.inf
    else:
        packed[..., :d] = res[0]
        packed[..., d] = res[1]
    everyone = step.comm.all_gather(packed)
    return merge_stacked(everyone[..., :d], everyone[..., d])
