"""Which global columns every context-parallel rank's cache holds (`ShardLayout`), shared by all layers
of one `cache.ShardedCache`, and, under DCP, which of its CP rank's slots this rank stores.

The layout is replicated metadata (a few integers per token, the same on every rank), so any rank can
build the mask for any other rank's block and know every message size without asking.
"""

from __future__ import annotations

import torch

from ..errors import CacheMismatchError
from .sharding import rank_counts, sequence_counts


class ShardLayout:
    """Which global columns every rank stores; shared by all layers of one cache.

    cols[r] is 1D while every sequence holds the same columns on rank r (prefill, replicated
    decode), and becomes a (batch, slots) table once batched pass-Q decode has placed each
    sequence's tokens on different ranks (-1 marks an empty slot). The layout changes only when
    a forward ends (`commit`), to what that forward's plan said.
    """

    def __init__(self, rank: int, world: int, windows=()):
        self.rank, self.world = rank, world
        self.cols: list[torch.Tensor] = [torch.empty(0, dtype=torch.long) for _ in range(world)]
        self.seq_length = 0  # committed global length (tokens of finished forwards)
        self.rotation = -1  # offset of the latest batched decode step (sequence b ran on rank (b + offset) % N)
        self.run = None  # the decode run left open (plan.Storage.run), continued by the next decode step
        # per sliding window: how many leading slots of each rank's columns its layers have dropped
        self.dropped = {w: [0] * world for w in sorted(set(windows) - {None})}
        self.record_past = False  # generate()'s assisted decoding: keep everything until crop()
        self.batch = None  # sequences of the committed tokens (None: none committed yet)
        # DCP (TP ranks sharing a KV head): this rank stores the slots s of its layout columns with
        # s % dcp_size == dcp_index (vLLM's interleave of 1: each rank within a token of the others); (0, 1): all
        self.dcp_index, self.dcp_size = 0, 1

    def set_dcp(self, index: int, size: int):
        """Store every size-th slot from `index` on (the runtime's DCP group); a cache that holds tokens
        under another split cannot change it."""
        if (index, size) != (self.dcp_index, self.dcp_size) and self.seq_length:
            raise CacheMismatchError(
                "this ShardedCache was filled with another KV-head sequence split (DCP): pass the cache this "
                "patched model returned, or none."
            )
        self.dcp_index, self.dcp_size = index, size

    def held(self, slots):
        """How many of the layout slots below `slots` (an int or a LongTensor) this rank holds under DCP:
        the buffer index a slot maps to, counted from slot 0."""
        if self.dcp_size == 1:
            return slots
        if isinstance(slots, torch.Tensor):
            return (slots - self.dcp_index + self.dcp_size - 1).div(self.dcp_size, rounding_mode="floor").clamp(min=0)
        return max(0, (slots - self.dcp_index + self.dcp_size - 1) // self.dcp_size)

    def mine(self, slots: torch.Tensor) -> torch.Tensor:
        """Bool mask of the layout slots this rank holds under DCP."""
        return slots % self.dcp_size == self.dcp_index

    def commit(self, storage):
        """Take the layout a forward's plan (`plan.Storage`) leaves."""
        self.cols, self.seq_length, self.rotation, self.run, self.batch = (
            list(storage.cols),
            storage.seq_length,
            storage.rotation,
            storage.run,
            storage.batch,
        )
        if self.dropped:
            self.dropped = storage.dropped

    def slots(self, rank: int) -> int:
        return self.cols[rank].shape[-1]

    def sequence_counts(self, batch: int) -> torch.Tensor:
        """(batch, world): how many tokens of each sequence every rank stores."""
        return sequence_counts(self.cols, batch)

    def counts(self) -> list[int]:
        """Tokens per rank (the most any one sequence holds there)."""
        return rank_counts(self.cols)

    def held_count(self) -> int:
        """Tokens this rank holds (the most any one sequence holds), its DCP share of its CP rank's."""
        cols = self.cols[self.rank]
        if self.dcp_size == 1 or cols.shape[-1] == 0:
            return self.counts()[self.rank]
        if cols.dim() == 1:
            return self.held(cols.numel())
        return int(((cols >= 0) & self.mine(torch.arange(cols.shape[1]))).sum(-1).max())

    def map_rows(self, fn):
        """Apply a batch reordering (beam search, batch selection) to per-sequence column tables."""
        self.cols = [fn(c) if c.dim() == 2 else c for c in self.cols]
        if self.batch is not None:
            self.batch = fn(torch.zeros(self.batch, 1, dtype=torch.long)).shape[0]
