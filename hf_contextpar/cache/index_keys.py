"""Indexed attention's (DSA's) index keys, which the cache stores 1/N per rank beside the K/V's columns and gathers
whole for each indexer layer (`gather_keys`, through `ShardedCache.update_indexer`), and Qwen4-Exp's position
history, kept the same way (`History`). Why every rank's indexer needs every column: attention/indexed.py. Here
because the model reaches them through its cache, which must not import the attention.
"""

from __future__ import annotations

import torch

from ..errors import PatchStateError
from ..plan.context import ForwardContext


def gather_keys(context: ForwardContext, cache, keys: torch.Tensor, layer: int) -> torch.Tensor:
    """The cache's `update_indexer`: every column's index keys (B, T, D) in global order, from every rank's
    stored share and this forward's new keys (one broadcast per rank, exact sizes); this rank keeps the
    columns the plan commits to it (its share of the K/V), so the index cache is 1/N per rank too."""
    plan, comm, layout = context.plan, context.comm, cache.layout
    if layout.dcp_size > 1 or any(c.dim() != 1 for c in layout.cols):
        raise PatchStateError("indexed attention runs without DCP and batched pass-Q decode (refused at apply).")
    held = cache.index_keys.get(layer)
    held = keys[:, :0] if held is None else held
    if held.shape[1] != layout.cols[comm.rank].numel():
        raise PatchStateError(
            f"layer {layer}'s index keys cover {held.shape[1]} columns but its K/V {layout.cols[comm.rank].numel()}: "
            "this model updates its indexer cache otherwise than once per forward with every new token."
        )
    cols = [torch.cat([before, new]) for before, new in zip(layout.cols, plan.shards.q_cols)]
    b, _, d = keys.shape
    pending = comm.broadcast_blocks(torch.cat([held, keys], dim=1), [(b, c.numel(), d) for c in cols], op="index_keys")
    full = keys.new_empty((b, plan.past + plan.num_new, d))
    for c, block in zip(cols, pending):
        full[:, c.to(full.device)] = block.wait()
    if plan.storage is not None:
        cache.index_keys[layer] = full[:, plan.storage.cols[comm.rank].to(full.device)]
    return full


POSITIONS = "positions"  # the key of the position history among the cache's index keys


class History:
    """Qwen4-Exp's position history (`indexer_position_ids` on its first indexed cache layer): the model reads it,
    appends its forward's own position ids and takes the query positions as the last of them, the keys' by global
    column (its block starts). So the history it reads is every column's positions in global order, this forward's
    new ones included (each rank's share of the past stored 1/N with the index keys, gathered as they are): the
    model's rotary table is then every column's then this rank's queries', and both lookups are one process's.
    Its 3 rows (MRoPE's) are the text positions on every row, as the model makes them from 2D ids."""

    rows = 3

    def __init__(self, context: ForwardContext, cache):
        self.context, self.cache = context, cache
        self.local = context.position_ids  # this rank's new position ids (B, Tq)
        self.full = None

    def __call__(self) -> torch.Tensor:
        if self.full is None:  # once per forward: the model reads it twice and the gather stores this rank's share
            cols = gather_keys(self.context, self.cache, self.local.unsqueeze(-1), POSITIONS)
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
