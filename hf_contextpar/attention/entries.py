"""Entries: keys a layer attends beside its cache layer's K/V, under a score bias of its own (DeepSeek-V4's
compressed entries, patches/deepseek_v4.py).

Such a layer hands its attention the cache layer's K/V with the entries concatenated after them, and keeps the
entries' bias (per query row and entry, -inf where a query may not see one) apart. The family's patch `record`s
(entries, bias) as the layer makes them; the attention adapter `split`s the handed K/V back into the cache
layer's (checked, then run by the plan's algorithm as any layer's) and the entries, which every rank holds whole
for its own queries: `run` attends them locally for a second (out, LSE) and merges it after the algorithm's, so
one softmax over [window | entries | sink] is one process's up to rounding. Queries must stay on their rank (the
bias and the entries' choice are made there): `check` refuses the strategies that move them.
"""

from __future__ import annotations

import torch

from ..cache.layers import ChainedLayerFactory
from ..errors import UnsupportedModelError
from ..plan.strategies import STRATEGIES
from .kernels import acc_dtype
from .merge import merge_pair

_RECORD = "_hf_contextpar_entries"


def check(settings, model_type: str, recurrence=None) -> None:
    """At apply, for a model with a family's own chained cache layers (`recurrence`: the contract's, None: assume
    so; DeepSeek-V4's): refuse what would move a query away from the rank holding its entries' bias."""
    if recurrence is not None and not any(isinstance(r, ChainedLayerFactory) for r in recurrence):
        return
    what = None
    if settings.strategy != "auto" and STRATEGIES[settings.strategy].moves_queries:
        what = f"strategy={settings.strategy!r} (it moves queries between ranks)"
    elif settings.sparse is not None:
        what = "sparse=CSA(...) (its own pruning)"
    if what is not None:
        raise UnsupportedModelError(
            f"{what} is not supported on {model_type}: its compressed attention's entries and their per-query bias "
            "(the indexer's top-k) are made on the rank that runs the query. Use strategy='auto', 'ring_pass_kv', "
            "'allgather_kv' or 'kv_runahead'."
        )


def record(module, keys: torch.Tensor, bias: torch.Tensor | None) -> None:
    """The layer's entries (B, 1, C, D), K=V, and their bias (B, 1, Tq, C) or None (every query sees every one);
    keys None: the layer attends with its cache layer's keys as values (K=V) and no entries."""
    module.__dict__[_RECORD] = (keys, bias)


def take(module):
    return module.__dict__.pop(_RECORD, None)


def split(step, module, key: torch.Tensor, value: torch.Tensor):
    """(key, value, entries): the cache layer's K/V as it handed them (so the structural guard sees them) and the
    recorded (entries, bias); the entries None for a layer that recorded none."""
    rec = take(module) if step is not None else None
    if rec is None:
        return key, value, None
    keys, bias = rec
    n = keys.shape[2] if keys is not None else 0  # None: a layer of the family without entries, K=V alone
    w = key.shape[2] - n
    ok = w >= 0 and value is key and (keys is None or torch.equal(key[:, :, w:], keys))
    if step.cache is not None and ok:
        stored = step.context.stored.get(module.layer_idx)  # what its cache layer's update returned
        ok = stored is not None and stored[0].shape == key[:, :, :w].shape and torch.equal(stored[0], key[:, :, :w])
        own = stored if ok else None
    else:
        own = (key[:, :, :w], value[:, :, :w])
    if not ok:
        raise UnsupportedModelError(
            f"{type(module).__name__} (layer {module.layer_idx}) attends with other keys than its cache layer's K=V "
            "followed by its compressed entries: this model cannot run exactly under context parallelism."
        )
    return *own, (keys, bias) if n else None


def run(call, algorithm, q: torch.Tensor, kv_local, attn: dict, extra):
    """The algorithm over the cache layer's K/V (no sinks, with its LSE), then the entries for this rank's queries,
    merged in that order: (out, lse) for the adapter, which applies the sinks. `call`: the layer's step.LayerStep."""
    out, lse = algorithm(call.but(sinks=None, wants_lse=True), q, kv_local, **attn)
    e_out, e_lse = attend_entries(q, *extra, attn["scale"])
    if out is None:
        return e_out, e_lse
    dtype = e_out.dtype
    return merge_pair(out.to(dtype), lse.to(dtype), e_out, e_lse)


SCORES_BYTES = (
    64 << 20
)  # one block of query rows' scores over the entries (V4-Flash: 64 heads; a CSA layer: T/4 entries)


def attend_entries(q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor | None, scale: float, budget=None):
    """(out, lse) of queries q (B, H, Tq, D) over the entries `keys` (B, 1, C, D), K=V, under `bias` (B, 1, Tq, C) or
    None, in the accumulation dtype: in blocks of query rows whose (B, H, rows, C) scores fit `budget` bytes, never
    the whole (B, H, Tq, C) at once (H times the model's own bias, twice over with their exponentials). `budget`:
    SCORES_BYTES, read at the call (tests/workers/v4_worker.py lowers it to run the blocks across ranks)."""
    budget = SCORES_BYTES if budget is None else budget
    dtype = acc_dtype(q.dtype)
    k = keys.to(dtype)
    b, h, tq, c = q.shape[0], q.shape[1], q.shape[2], k.shape[-2]
    if bias is not None and bias.shape[-2] not in (1, tq):
        raise ValueError(f"the entries' bias has {bias.shape[-2]} query rows for {tq} queries")
    rows = max(1, budget // max(1, b * h * c * torch.finfo(dtype).bits // 8))
    outs, lses = [], []
    for start in range(0, max(tq, 1), rows):  # no query row: one empty block, empty results
        scores = torch.matmul(q[..., start : start + rows, :].to(dtype), k.transpose(-1, -2)) * scale
        if bias is not None:  # a bias of one row broadcasts over the queries
            scores += (bias if bias.shape[-2] == 1 else bias[..., start : start + rows, :]).to(dtype)
        lse = torch.logsumexp(scores, dim=-1)
        scores -= lse.masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1)
        outs.append(torch.matmul(scores.exp_(), k))
        lses.append(lse)
    return (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs, -2), torch.cat(lses, -1))
