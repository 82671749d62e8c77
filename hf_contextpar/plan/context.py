"""One rank's running forward: what the cache and the attention adapter share while it runs (`ForwardContext`).

The plan (forward.py) is read-only and the same on every rank; the layout (layout.py) is what the cache holds
between forwards. What a forward accumulates while it runs (which cache layers stored, which received blocks this
rank keeps, what the cache must be able to undo) belongs to neither: it lives here, in one object made from the plan
when the forward starts, handed to the cache (`ShardedCache.begin`) and to the attention (through its `Step`), and
dropped when the forward ends, so nothing of one forward can leak into the next through a long-lived object.
It sits in plan/ so that both cache/ and attention/ can import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .forward import ForwardPlan, RankCommit


@dataclass
class ForwardContext:
    """This rank's running forward: made by `forward_context`, read and filled by the cache and the attention."""

    plan: ForwardPlan
    rank: int
    comm: object  # this rank's communicator (comm.collectives.Comm): the cache's index-key exchange uses it
    stored: dict = field(default_factory=dict)  # cache layer -> (keys, values) its update returned in this forward
    arrived: dict = field(default_factory=dict)  # cache layer -> [(first column, K/V)] received blocks it keeps
    undo: object = None  # what the cache needs to forget this forward's stores if it fails (ShardedCache.begin)
    # indexed attention (DSA) in this forward: its indexer (attention/indexed.Indexer), which the cache's
    # update_indexer and position history hand over to; None: none runs
    indexer: object = None
    # the recurrent chain of this forward (cache/recurrent.StateChain: the states passed down the ranks), which the
    # cache's state accessors go through; None: not chained
    chain: object = None

    @property
    def store(self) -> RankCommit | None:
        """Which of this forward's K/V this rank keeps (None: the forward runs without a cache)."""
        return self.plan.storage.store[self.rank] if self.plan.storage is not None else None

    def arrive(self, layer: int, block: torch.Tensor, cols: torch.Tensor) -> None:
        """Rank src's K/V block of cache layer `layer` (its columns `cols`) arrived: keep a copy of the new columns this
        rank commits of it (rebalancing, forward._rebalanced), so the message buffer can go; the cache places them
        among this rank's own new tokens when the forward ends (`ShardedLayer.rebalance`)."""
        lo, hi = self.store.rebalance[:2]
        keep = torch.nonzero((cols >= lo) & (cols < hi)).flatten()
        if keep.numel():
            self.arrived.setdefault(layer, []).append(
                (int(cols[keep[0]]), block.index_select(3, keep.to(block.device)))
            )


def forward_context(plan: ForwardPlan, rank: int, comm) -> ForwardContext:
    """The context of the forward `plan` describes, on rank `rank`: empty of everything it will accumulate (the
    capabilities that run in it, DSA's indexer and the recurrent chain, are put on it by the runtime)."""
    return ForwardContext(plan, rank, comm)
