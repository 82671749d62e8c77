"""One rank's execution of a forward plan: what every attention layer of the forward reads.

Apart from the runtime's hooks, which build it, the simulated ranks of `hf_contextpar.tools.simulated`
build it too, to run the attention algorithms without a model or a process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .comm import Comm
from .plan import ForwardPlan

if TYPE_CHECKING:
    from .cache import ShardedCache


@dataclass
class Step:
    """One rank's execution of a plan: what every attention layer of the forward reads."""

    plan: ForwardPlan
    comm: Comm
    cache: ShardedCache | None
    num_layers: int
    layer: int = 0  # index of the attention layer running now
    state: dict = field(default_factory=dict)  # what an algorithm carries from one layer to the next
    attended: set = field(default_factory=set)  # layers whose attention ran in this forward (once each)
    sinks: torch.Tensor | None = None  # the running layer's attention sinks (H,), if the model has them

    def __post_init__(self):
        self.windows = self.cache.windows if self.cache is not None else (None,) * self.num_layers

    @property
    def algorithm(self) -> str:
        return self.plan.algorithm

    @property
    def q_cols(self) -> torch.Tensor:
        return self.plan.shards.q_cols[self.comm.rank]

    @property
    def q_cols_all(self) -> list:
        return self.plan.shards.q_cols

    @property
    def kv_cols(self) -> list:
        """Per rank: the key columns the running layer holds (a sliding layer keeps fewer)."""
        return self.plan.shards.kv_cols_for(self.windows[self.layer])

    def kv_size(self, rank: int, layer: int | None = None) -> int:
        return self.plan.shards.kv_size(rank, self.windows[self.layer if layer is None else layer])

    @property
    def padding(self):
        return self.plan.padding

    @property
    def batch_rows(self):
        return self.plan.shards.seq_rows

    def batch_size(self, rank) -> int:
        return len(range(self.plan.batch)[self.plan.shards.seq_rows[rank]])

    def key_valid(self, rank, rows=slice(None)):
        """(B, Tk) bool for rank's keys (rank None: this forward's own), padding = False; None if no padding."""
        if self.plan.padding is None:
            return None
        cols = self.q_cols if rank is None else self.kv_cols[rank]
        pad = self.plan.padding[rows]
        if cols.dim() == 2:
            return pad.gather(1, cols[rows].clamp(min=0).to(pad.device))
        return pad[:, cols.to(pad.device)]
