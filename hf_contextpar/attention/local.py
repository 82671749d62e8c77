"""Local attention: every rank holds every key of the forward (a short forward without a cache,
which every rank runs whole), so no message is needed."""

from __future__ import annotations

from .kernels import attend


def local(step, q, kv_local, **attn):
    k, v = step.unpack(kv_local, step.comm.rank)
    res = attend(q, k, v, step.q_cols, step.q_cols, key_valid=step.key_valid(None), **attn)
    return res if res is not None else (None, None)
