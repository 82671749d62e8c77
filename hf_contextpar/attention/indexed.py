"""Indexed attention (DeepSeek Sparse Attention, DSA: DeepSeek-V3.2, GLM-5, ...): the one-process top-k.

A DSA layer's "lightning indexer" scores every earlier token for each query against its own
one-head keys (cached by `cache.update_indexer`), keeps the `index_topk` best, and the attention
runs over those keys only. transformers hands the chosen global columns to a non-eager attention
as `indices` (B, Tq, k). Under context parallelism that choice must be the one a single process
makes, ties included: a top-k per rank merged afterwards picks among equal scores in a
rank-dependent order (the bug that gave vLLM garbled tokens), and even a merge that keeps every
tie cannot reproduce how `torch.topk` orders equal values in a row it never saw whole.

So every rank gives the model's own indexer the whole row: `Indexer.gather` (behind the cache's
`update_indexer`, which hands it to the forward's indexer) all-gathers every rank's stored index keys and this forward's new ones into
global column order, and `indexer_mask` (the mask function's output for these models) is the
causal and padding visibility of this rank's query columns over every column. The indexer then
runs its own arithmetic and its own `topk` over a row of the same length, in the same column order,
with the same values (up to the last bit of the hidden states, as everywhere else), so ties resolve
as on one process. Its indices are global columns: `selection` turns them into a (B, Tq, T) bool
that `kernels.attend` intersects with each block's visibility, in whichever algorithm keeps the
queries on their rank (those that move queries are refused: plan/strategies.py `moves_queries`).

What it costs: the index keys are one head of `index_head_dim` numbers a token (128 in DeepSeek-V3.2
and GLM-5: 256 bytes in bf16, against the latent KV's 576 numbers, 1,152 bytes), stored 1/N per rank
with the K/V's columns and gathered whole per indexer layer and forward: (T - T/N) x 256 bytes a
layer received per rank, 22 % of what all-gathering the latent KV would move.

This file is DSA's one room: its refusals at apply (`check`) and per layer (`layer_selection`), the mask
function's part (`forward_mask`), the adapter's (`layer_selection`, one call a layer) and the cache's (`Indexer`, which the
runtime puts on the forward's context and the cache's `update_indexer` and position history call: the cache stores
the index keys, this file decides what they are). A family that hands its top-k otherwise (Qwen4-Exp's narrowed mask)
says so through its hooks (`FamilyHooks.selection`, patches/).
"""

from __future__ import annotations

import torch

from ..errors import PatchStateError, UnsupportedModelError
from ..plan.context import ForwardContext
from ..plan.strategies import STRATEGIES
from .masks import visible

MASK = "indexer_mask"  # the key of the forward's indexer mask among its Step's state


def check(facts) -> frozenset:
    """At apply (capabilities.py): the model's indexed-attention layers, after `check_indexed`'s refusals."""
    return check_indexed(facts.config, facts.settings, facts.dcp is not None, facts.hooks.indexed_layer_type())


def check_indexed(config, settings, dcp: bool, kind: str = "indexed_attention") -> frozenset:
    """The model's indexed-attention layers (DSA, attention/indexed.py; empty: none), after refusing what would move
    a query away from the rank whose indexer chose its keys: pass-Q and Ulysses, batched pass-Q decode, DCP, CSA.
    Its other layers (dots3's sliding MLA layers) attend to every visible key, as on one process. kind: the
    `layer_types` name of its layers with an indexer (`FamilyHooks.indexed_layer_type`)."""
    text = config.get_text_config(decoder=True)
    layers = frozenset(i for i, t in enumerate(getattr(text, "layer_types", None) or ()) if t == kind)
    if not layers:
        return layers
    what = None
    if settings.strategy != "auto" and STRATEGIES[settings.strategy].moves_queries:
        what = f"strategy={settings.strategy!r} (it moves queries between ranks)"
    elif settings.decode == "ring_pass_q":
        what = "decode='ring_pass_q' (batched pass-Q decode moves each sequence's query round the ranks)"
    elif dcp:
        what = "DCP (TP beyond the KV heads: each TP rank holds every other token)"
    elif settings.sparse is not None:
        what = "sparse=CSA(...) (its own pruning, not the indexer's selection)"
    if what is not None:
        raise UnsupportedModelError(
            f"{what} is not supported on a model with indexed attention (DSA, {config.model_type}): each query's "
            "top-k keys are chosen on the rank that runs the query, over every rank's index keys, and applied to "
            "the blocks that rank attends. Use strategy='auto', 'ring_pass_kv', 'allgather_kv' or 'kv_runahead' "
            "and decode='auto' or 'replicated'."
        )
    return layers


def indexer_mask(step, device=None) -> torch.Tensor:
    """(B, 1, Tq, T) bool, True where this rank's query column may score a key column: causal over global
    columns and not padding. What the model's 4D mask is on one process, for the indexer's row of every key."""
    plan = step.plan
    total = plan.past + plan.num_new
    vis = visible(step.q_cols, torch.arange(total), None, device)  # (1, Tq, T)
    if step.padding is not None:
        vis = vis & step.padding[:, None, :total].to(device=vis.device, dtype=torch.bool)
    return vis.expand(plan.batch, -1, -1).unsqueeze(1)


def selection(step, indices: torch.Tensor) -> torch.Tensor:
    """(B, Tq, T) bool from the indexer's (B, Tq, k) global columns: True where the query keeps the key.
    Masked columns a row had to take (k above its visible keys) stay excluded by each block's visibility."""
    plan = step.plan
    total = plan.past + plan.num_new
    if indices.shape[:2] != (plan.batch, step.q_cols.numel()) or (indices.numel() and int(indices.max()) >= total):
        raise PatchStateError(
            f"the indexer chose columns of shape {tuple(indices.shape)} (max {int(indices.max())}) for "
            f"{step.q_cols.numel()} query rows over {total} keys: it did not score this rank's queries against every "
            "column. Please report this model."
        )
    keep = torch.zeros((plan.batch, indices.shape[1], total), dtype=torch.bool, device=indices.device)
    return keep.scatter_(-1, indices.long(), True)


def block_selection(step, blocks: torch.Tensor, width: int) -> torch.Tensor:
    """(B, H, Tq, T) bool from a block indexer's (B, H, Tq, k) block numbers (-1: an unused slot), each block `width`
    global columns counted from column 0 (MiniMax-M3's, whose blocks are its cache's slots): True where the query,
    for selection head h (a KV head's group), keeps the key. One process's blocks, since slot = global column."""
    plan = step.plan
    total = plan.past + plan.num_new
    count = -(-total // width)
    rows = step.q_cols.numel()
    top = int(blocks.max()) if blocks.numel() else -1
    if blocks.dim() != 4 or blocks.shape[0] != plan.batch or blocks.shape[2] != rows or top >= count:
        raise PatchStateError(
            f"the indexer chose blocks of shape {tuple(blocks.shape)} (max {top}) for {rows} query "
            f"rows over {count} blocks of {width} keys: it did not score this rank's queries against every column. "
            "Please report this model."
        )
    safe = blocks.long().masked_fill(blocks < 0, count)  # an unused slot lands in a column dropped below
    keep = torch.zeros((*blocks.shape[:3], count + 1), dtype=torch.bool, device=blocks.device).scatter_(-1, safe, True)
    return keep[..., :count].repeat_interleave(width, dim=-1)[..., :total]


def forward_mask(step, device=None) -> torch.Tensor:
    """The mask function's answer on a model with indexed attention: the indexer's mask, one per forward (every
    layer kind gets it: dots3's sliding layers too), which its attention hands back untouched."""
    if MASK not in step.state:
        step.state[MASK] = indexer_mask(step, device)
    return step.state[MASK]


def layer_selection(step, module, attention_mask, indices, handed: dict | None = None):
    """Indexed attention's part of one layer's call, in one: (the (B, Tq, T) keys the layer's indexer kept for this
    rank's queries, (B, H, Tq, T) per KV head for a block indexer's, None for a layer without an indexer; the
    attention mask left for the adapter's own check, None where it was the indexer's). `handed`: the call's other
    keyword arguments, where a family hands its blocks (`FamilyHooks.selected_blocks`). A mask of the layer's own is
    left to the adapter, which refuses it first; anything else the algorithms cannot run exactly is refused here
    (`_selection`), never approximated."""
    narrowed, left = _narrowed(step, module, attention_mask, indices)
    if left is not None and left.dim() != 2:
        return None, left
    if narrowed is None and indices is None and step is not None and step.family is not None:
        blocks = step.family.selected_blocks(module, handed or {})
        narrowed = block_selection(step, *blocks) if blocks is not None else None
    return _selection(step, module, indices, narrowed), left


def _narrowed(step, module, attention_mask, indices):
    """(the layer's selection read from its mask, the mask left for the adapter's own check): the indexer's mask
    handed back is no mask of the layer's own (None left); a family that narrows that mask to the kept keys instead
    of passing indices= (`FamilyHooks.selection`: Qwen4-Exp's QSA) hands its selection that way."""
    if step is None or not step.indexed:
        return None, attention_mask
    ours = step.state.get(MASK)
    if attention_mask is ours:
        return None, None
    if indices is not None or getattr(module, "layer_idx", None) not in step.indexed:
        return None, attention_mask
    select = step.family.selection(module, attention_mask, ours)
    return select, (None if select is not None else attention_mask)


def _selection(step, module, indices, narrowed=None):
    """The (B, Tq, T) keys the layer's indexer kept for this rank's queries (as indices=, or as its mask narrowed:
    `_narrowed`), None for a layer without an indexer; refused where the algorithms cannot run it exactly."""
    if not step.indexed or getattr(module, "layer_idx", None) not in step.indexed:
        if indices is not None or narrowed is not None:
            raise UnsupportedModelError(
                f"{type(module).__name__} hands its attention a top-k selection (indices= or key blocks) but its config "
                "declares this layer no indexed-attention layer: this model cannot run exactly under context parallelism."
            )
        return None
    if indices is None and narrowed is None:
        raise UnsupportedModelError(
            f"{type(module).__name__} (layer {module.layer_idx}) is an indexed-attention layer that gave its attention "
            "no top-k selection (indices=, or its indexer's mask narrowed to the kept keys): hf-contextpar would "
            "attend to every key instead of the selected ones."
        )
    if STRATEGIES[step.algorithm].moves_queries:
        raise UnsupportedModelError(
            f"the {step.algorithm!r} algorithm moves queries between ranks, where their indexer's selection is not: "
            "indexed attention (DSA) runs ring pass-KV, all-gather KV or KV-Runahead, and replicated decode."
        )
    return selection(step, indices) if indices is not None else narrowed


class Indexer:
    """One forward's indexer on one rank, on its context (`ForwardContext.indexer`): what the cache's
    `update_indexer` and its position history hand over to. The cache stores the index keys (its `index_keys`, 1/N
    per rank beside the K/V's columns, following it through beams, crops and failures); this decides what every
    rank's indexer reads."""

    def __init__(self, context: ForwardContext, cache, position_ids: torch.Tensor):
        self.context, self.cache = context, cache  # the cache the forward runs with (ShardedCache)
        self.position_ids = position_ids  # this rank's new tokens' position ids (B, Tq), as the model gets them
        self._history = None

    def gather(self, keys: torch.Tensor, layer) -> torch.Tensor:
        """The cache's `update_indexer`: every column's index keys (B, T, D) in global order, from every rank's
        stored share and this forward's new keys (one broadcast per rank, exact sizes); this rank keeps the
        columns the plan commits to it (its share of the K/V), so the index cache is 1/N per rank too."""
        plan, comm, cache = self.context.plan, self.context.comm, self.cache
        layout = cache.layout
        if layout.dcp_size > 1 or any(c.dim() != 1 for c in layout.cols):
            raise PatchStateError("indexed attention runs without DCP and batched pass-Q decode (refused at apply).")
        held = cache.index_keys.get(layer)
        held = keys[:, :0] if held is None else held
        if held.shape[1] != layout.cols[comm.rank].numel():
            raise PatchStateError(
                f"layer {layer}'s index keys cover {held.shape[1]} columns but its K/V "
                f"{layout.cols[comm.rank].numel()}: this model updates its indexer cache otherwise than once per "
                "forward with every new token."
            )
        cols = [torch.cat([before, new]) for before, new in zip(layout.cols, plan.shards.q_cols)]
        b, _, d = keys.shape
        blocks = torch.cat([held, keys], dim=1)
        pending = comm.broadcast_blocks(blocks, [(b, c.numel(), d) for c in cols], op="index_keys")
        full = keys.new_empty((b, plan.past + plan.num_new, d))
        for c, block in zip(cols, pending):
            full[:, c.to(full.device)] = block.wait()
        if plan.storage is not None:
            cache.index_keys[layer] = full[:, plan.storage.cols[comm.rank].to(full.device)]
        return full

    @property
    def history(self) -> History:
        """The forward's position history (Qwen4-Exp's `indexer_position_ids`), made on first read."""
        if self._history is None:
            self._history = History(self)
        return self._history


POSITIONS = "positions"  # the key of the position history among the cache's index keys


class History:
    """Qwen4-Exp's position history (`indexer_position_ids` on its first indexed cache layer): the model reads it,
    appends its forward's own position ids and takes the query positions as the last of them, the keys' by global
    column (its block starts). So the history it reads is every column's positions in global order, this forward's
    new ones included (each rank's share of the past stored 1/N with the index keys, gathered as they are): the
    model's rotary table is then every column's then this rank's queries', and both lookups are one process's.
    Its 3 rows (MRoPE's) are the text positions on every row, as the model makes them from 2D ids."""

    rows = 3

    def __init__(self, indexer: Indexer):
        self.indexer = indexer
        self.local = indexer.position_ids
        self.full = None

    def __call__(self) -> torch.Tensor:
        if self.full is None:  # once per forward: the model reads it twice and the gather stores this rank's share
            cols = self.indexer.gather(self.local.unsqueeze(-1), POSITIONS)
            self.full = cols[..., 0].unsqueeze(0).expand(self.rows, -1, -1)
        return self.full

    def check(self, value: torch.Tensor):
        """What the model writes back must be the history then this rank's queries' positions."""
        full = self()
        want = torch.cat([full, self.local.unsqueeze(0).expand(self.rows, -1, -1).to(full.device)], dim=-1)
        if value.shape != want.shape or not torch.equal(value.to(want.device), want):
            raise PatchStateError(
                f"the model stored position ids of shape {tuple(value.shape)} on its indexer cache layer, not the "
                f"whole sequence's then this rank's queries' {tuple(want.shape)}: it keeps its position history "
                "otherwise than Qwen4-Exp does. Please report this model."
            )
