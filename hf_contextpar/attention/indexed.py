"""Indexed attention (DeepSeek Sparse Attention, DSA: DeepSeek-V3.2, GLM-5, ...): the one-process top-k.

A DSA layer's "lightning indexer" scores every earlier token for each query against its own
one-head keys (cached by `cache.update_indexer`), keeps the `index_topk` best, and the attention
runs over those keys only. transformers hands the chosen global columns to a non-eager attention
as `indices` (B, Tq, k). Under context parallelism that choice must be the one a single process
makes, ties included: a top-k per rank merged afterwards picks among equal scores in a
rank-dependent order (the bug that gave vLLM garbled tokens), and even a merge that keeps every
tie cannot reproduce how `torch.topk` orders equal values in a row it never saw whole.

So every rank gives the model's own indexer the whole row: `cache.index_keys.gather_keys` (the cache's
`update_indexer`) all-gathers every rank's stored index keys and this forward's new ones into
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
"""

from __future__ import annotations

import torch

from ..errors import PatchStateError, UnsupportedModelError
from ..plan.strategies import STRATEGIES
from .masks import visible


def check_indexed(config, settings, dcp: bool) -> frozenset:
    """The model's indexed-attention layers (DSA, attention/indexed.py; empty: none), after refusing what would move
    a query away from the rank whose indexer chose its keys: pass-Q and Ulysses, batched pass-Q decode, DCP, CSA.
    Its other layers (dots3's sliding MLA layers) attend to every visible key, as on one process."""
    text = config.get_text_config(decoder=True)
    layers = frozenset(i for i, t in enumerate(getattr(text, "layer_types", None) or ()) if t == "indexed_attention")
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
