"""CSA on one process: the same definition (sparse/csa.py) applied as a mask to the unpatched model.

`csa_reference(model, CSA(...), world=N, partitions=...)` switches the model's attention, for the `with` block,
to one that cuts each fresh prompt into the N contiguous partitions the distributed run uses (placement decides
levels: `partitions` is the run's, `get_runtime(cp).partitions` or a list; even without it) and lets a
query of partition d see its own partition causally and, of each earlier partition s, the keys kept at
level(s, d) by the previous attention layer's importance order, each padding key masked. Everything
else (a prefill over a cache, decode, prompts too short to split) attends exactly. It shares with the
distributed algorithm (attention/csa.py) only the definitional pieces (levels, kept counts, the order),
not its kernels, messages or cache: the sparse path is checked against its own definition with this, and
`model.generate` inside the block is what the eval harness compares the approximate mode's cost with.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from transformers.cache_utils import DynamicCache

from hf_contextpar.cache.sharded import cache_recurrence
from hf_contextpar.model.families import REGISTRY
from hf_contextpar.plan.partitions import PartitionTable, even
from hf_contextpar.sparse.csa import (
    CSA,
    SparseRun,
    full_layers,
    importance_order,
    kept_counts,
    observed_rows,
    refuse_layers,
)

NAME = "hf_contextpar_csa_reference"


@contextmanager
def csa_reference(model, csa: CSA, world: int, partitions=None):
    """Within the block, `model` (unpatched, one process) attends as `world` ranks running `csa` would.
    partitions: the sizes a fresh prompt of T tokens is cut into: a callable T -> sizes (the distributed run's
    `get_runtime(model).partitions`: the balanced default is the same in every run), a
    list (one prompt length), a PartitionTable (or its dict), or None: even (`partitions="even"`)."""
    refuse_layers(model.config)
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    chained = any(r.states for r in cache_recurrence(DynamicCache(config=model.config)))
    reference = _Reference(SparseRun.of(csa, world, full_layers(model.config)), world, chained, _sizes(partitions))
    AttentionInterface.register(NAME, reference)
    AttentionMaskInterface.register(NAME, _padding_mask)
    # the family's patch, as the distributed run installs it: a family whose attention transformers keeps hand-written
    # (Falcon, GPT-Neo, XGLM: patches/ported.py) calls the attention its config names only once ported; unported,
    # it would keep its own and attend to every key (a patch changes nothing else a one-process forward computes)
    family = REGISTRY.get(model.config.model_type)
    undo = family.apply(model) if family is not None and family.apply is not None else (lambda: None)
    original = model.config._attn_implementation
    try:
        model.set_attn_implementation(NAME)
        yield model
    finally:
        model.set_attn_implementation(original)
        undo()


def _padding_mask(batch_size=None, q_length=None, kv_length=None, attention_mask=None, **kwargs):
    """The 2D padding mask (B, keys), as the library's own attention takes it."""
    return None if attention_mask is None or bool(attention_mask.all()) else attention_mask


def _sizes(partitions):
    """partitions as a callable T -> sizes or None (what the distributed plan reads of `Policy.partitions`)."""
    if partitions is None or callable(partitions):
        return partitions
    if isinstance(partitions, (list, tuple)):
        fixed = [int(n) for n in partitions]

        def given(num_tokens: int) -> list:
            if sum(fixed) != num_tokens:
                raise ValueError(f"csa_reference: partitions {fixed} hold {sum(fixed)} tokens, the prompt {num_tokens}")
            return fixed

        return given
    table = PartitionTable.load(partitions)
    return lambda num_tokens: table.sizes(num_tokens, table.world)


class _Reference:
    def __init__(self, run: SparseRun, world: int, chained: bool, sizes=None):
        self.run, self.world, self.least = run, world, world * (2 if chained else 1)
        self.sizes, self.chained = sizes, chained
        self.orders = None  # per partition: the previous attention layer's order of its keys

    def __call__(
        self,
        module,
        query,
        key,
        value,
        attention_mask,
        scaling=None,
        dropout=0.0,
        sliding_window=None,
        softcap=None,
        **kw,
    ):
        scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
        tq, tk = query.shape[2], key.shape[2]
        valid = attention_mask[:, -tk:].bool() if attention_mask is not None else None  # a sliding cache: the last
        if module.layer_idx == min(self.run.exact, default=-1):
            self.orders = None  # a new forward
        if tk != tq or tq < self.least or sliding_window is not None:  # over a cache, too short, sliding: exact
            vis = _causal(torch.arange(tk - tq, tk), torch.arange(tk), valid, sliding_window)
            return _attend(query, key, value, vis.unsqueeze(1), scale, softcap), None
        out, orders = _sparse(self, module.layer_idx, query, key, value, valid, scale, softcap)
        self.orders = orders
        return out, None


def _sparse(ref: _Reference, layer: int, query, key, value, valid, scale, softcap):
    """One fresh prefill's layer under CSA: per query partition, its visible keys as a (B, Hkv, rows, keys) mask."""
    csa, tq = ref.run.csa, query.shape[2]
    sizes = ref.sizes(tq) if ref.sizes is not None else None
    sizes = sizes if sizes and len(sizes) == ref.world and min(sizes) >= (2 if ref.chained else 0) else None
    bounds = [0, *torch.tensor(sizes or even(tq, ref.world)).cumsum(0).tolist()]
    parts = [torch.arange(a, b) for a, b in zip(bounds, bounds[1:])]
    exact = ref.orders is None or layer in ref.run.exact
    outs, orders = [], []
    for d, rows in enumerate(parts):
        # (B, Hkv, rows, keys): per sequence even without a padding mask, since each sequence keeps its own keys
        vis = _causal(rows, torch.arange(tq), valid).unsqueeze(1).expand(query.shape[0], key.shape[1], -1, -1).clone()
        for s in range(0 if exact else d):  # an earlier partition: the keys its level keeps (all in the past)
            kept = _kept_mask(ref.orders[s], valid, parts[s], csa.fraction(csa.levels(s, d)))
            vis[..., parts[s]] = kept.expand(-1, -1, len(rows), -1)
        outs.append(_attend(query[:, :, rows], key, value, vis, scale, softcap))
        if layer != ref.run.last:
            obs = rows[observed_rows(len(rows), csa.observe)]
            row_valid = valid[:, obs] if valid is not None else None
            key_valid = valid[:, rows] if valid is not None else None
            orders.append(
                importance_order(query[:, :, obs], key[:, :, rows], obs, rows, row_valid, key_valid, scale, softcap)
            )
    return torch.cat(outs, dim=1), orders if layer != ref.run.last else None


def _kept_mask(order, valid, cols, fraction):
    """(B, Hkv, 1, len(cols)) bool: the keys of one partition kept at `fraction` (a prefix of its order)."""
    b, hkv, n = order.shape
    counts = kept_counts(valid[:, cols] if valid is not None else None, n, b, fraction)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(n).expand(b, hkv, n).contiguous())  # each key's place in the order
    return (rank < counts.view(b, 1, 1)).unsqueeze(2)


def _causal(q_cols, k_cols, valid, window=None):
    """(B or 1, rows, keys) bool: key column <= query column (and within the window), and not padding."""
    vis = (k_cols.view(1, -1) <= q_cols.view(-1, 1)).unsqueeze(0)
    if window is not None:
        vis = vis & (k_cols.view(1, -1) > q_cols.view(-1, 1) - window).unsqueeze(0)
    return vis & valid[:, None, :] if valid is not None else vis


ROWS = 1024  # query rows per step of `_attend`: its scores are (rows x keys) per head, 1 GiB at 16K x 16K in fp32


def _attend(q, k, v, vis, scale, softcap):
    """(B, rows, H, D) softmax attention under vis (B or 1, Hkv or 1, rows, keys), in the accumulation dtype;
    a row that sees no key gives zeros (the library's output for one). Rows go ROWS at a time: each row's
    softmax is its own, so the steps change nothing but the memory (a 16K prompt's scores on 4 processes at
    once would not fit a small machine)."""
    if q.shape[2] > ROWS:
        steps = range(0, q.shape[2], ROWS)
        return torch.cat(
            [_attend(q[:, :, i : i + ROWS], k, v, vis[..., i : i + ROWS, :], scale, softcap) for i in steps], 1
        )
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, h, t, d = q.shape
    hkv = k.shape[1]
    qg = q.to(acc).view(b, hkv, h // hkv, t, d)
    s = torch.einsum("bgqtd,bgkd->bgqtk", qg, k.to(acc)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~vis.to(q.device).unsqueeze(2), -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bgqtk,bgkd->bgqtd", p, v.to(acc)).reshape(b, h, t, v.shape[-1])
    # contiguous, as transformers' attention functions return it (AFMoE views it)
    return out.to(q.dtype).transpose(1, 2).contiguous()
