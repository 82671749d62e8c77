"""A transformers `Cache` that holds only this rank's slice of the KV cache.

Each rank stores the K/V of the tokens it owns, in sequence-major packed buffers of shape
(tokens, 2, batch, kv_heads, head_dim): a shard is then one contiguous prefix that the ring
sends without a copy, and decode appends without re-concatenating. The global columns of
every rank's tokens are replicated metadata (a few integers per token), so any rank can build
the mask for any other rank's block without asking for it. `get_seq_length()` reports the
*global* length, so `generate()` keeps its bookkeeping unchanged.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .errors import ContextParallelError


class ShardLayout:
    """Which global columns every rank stores; shared by all layers of one cache.

    cols[r] is 1D while every sequence holds the same columns on rank r (prefill, replicated
    decode), and becomes a (batch, slots) table once batched pass-Q decode has placed each
    sequence's tokens on different ranks (-1 marks a slot not filled yet).
    """

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.cols: list[torch.Tensor] = [torch.empty(0, dtype=torch.long) for _ in range(world)]
        self.seq_length = 0  # committed global length (tokens of finished forwards)
        self.store_rows: torch.Tensor | None = None  # rows of the running forward's K/V kept here; None = all
        self.store_slots: tuple | None = None  # (batch rows, slots) of this rank's K/V in a batched decode step
        self.rotation = -1  # offset of the latest batched pass-Q decode step (sequence b ran on rank (b + offset) % N)

    def begin(self, new_cols: list[torch.Tensor], store_rows: torch.Tensor | None):
        """Every sequence appends the same columns (new_cols[r] on rank r)."""
        self.cols = [torch.cat([c, n]) if c.dim() == 1 else torch.cat([c, n.expand(c.shape[0], -1)], dim=1)
                     for c, n in zip(self.cols, new_cols)]
        self.store_rows = store_rows

    def begin_rows(self, col: int, rows_per_rank: list, batch: int):
        """One new column per sequence; rank r stores it for the batch rows rows_per_rank[r] (slices)."""
        for r, rows in enumerate(rows_per_rank):
            c = self.cols[r]
            if c.dim() == 1:
                c = c.expand(batch, -1).clone()
            filled = c >= 0
            last = torch.where(filled.any(1), c.shape[1] - 1 - filled.flip(1).int().argmax(1), -1)
            idx = torch.arange(batch)[rows]
            slots = last[idx] + 1
            need = int(slots.max()) + 1 if idx.numel() else 0
            if need > c.shape[1]:
                c = torch.cat([c, c.new_full((batch, need - c.shape[1]), -1)], dim=1)
            c[idx, slots] = col
            self.cols[r] = c
            if r == self.rank:
                self.store_slots = (idx, slots)

    def end(self, seq_length: int):
        self.seq_length = seq_length
        self.store_rows = self.store_slots = None

    def slots(self, rank: int) -> int:
        return self.cols[rank].shape[-1]

    def sequence_counts(self, batch: int) -> torch.Tensor:
        """(batch, world): how many tokens of each sequence every rank stores."""
        return torch.stack([(c >= 0).sum(-1) if c.dim() == 2 else torch.full((batch,), c.numel()) for c in self.cols], 1)

    def counts(self) -> list[int]:
        """Tokens per rank (the most any one sequence holds there)."""
        return [int((c >= 0).sum(-1).max()) if c.dim() == 2 else c.numel() for c in self.cols]

    def map_rows(self, fn):
        """Apply a batch reordering (beam search, batch selection) to per-sequence column tables."""
        self.cols = [fn(c) if c.dim() == 2 else c for c in self.cols]


class ShardedLayer(CacheLayerMixin):
    is_sliding = False
    is_croppable = True

    def __init__(self, layout: ShardLayout):
        super().__init__()
        self.layout = layout
        self.kv: torch.Tensor | None = None  # (capacity, 2, B, Hkv, D)
        self.n = 0

    def lazy_initialization(self, key_states, value_states):
        if key_states.shape != value_states.shape:
            raise ContextParallelError(
                "hf-contextpar packs K and V together and needs them to have the same shape; "
                f"this model has keys {tuple(key_states.shape)} and values {tuple(value_states.shape)}."
            )
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        self.kv = torch.empty((0, 2, b, h, d), dtype=self.dtype, device=self.device)
        self.n = 0
        self.is_initialized = True

    def _reserve(self, n: int):
        if n > self.kv.shape[0]:
            grown = torch.empty((max(2 * self.kv.shape[0], n, 64), *self.kv.shape[1:]),
                                dtype=self.kv.dtype, device=self.kv.device)
            grown[: self.n] = self.kv[: self.n]
            self.kv = grown

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.layout.store_slots is not None:  # batched pass-Q decode: one token for some sequences
            rows, slots = self.layout.store_slots
            n = self.layout.slots(self.layout.rank)
            self._reserve(n)
            self.kv[self.n : n] = 0  # new slots start empty; masked, but must hold finite values
            self.kv[slots.to(self.kv.device), 0, rows.to(self.kv.device)] = key_states[:, :, 0]
            self.kv[slots.to(self.kv.device), 1, rows.to(self.kv.device)] = value_states[:, :, 0]
            self._keep(n)
            return self.keys, self.values
        rows = self.layout.store_rows
        if rows is not None:
            rows = rows.to(key_states.device)
            key_states, value_states = key_states.index_select(2, rows), value_states.index_select(2, rows)
        m = key_states.shape[2]
        self._reserve(self.n + m)
        self.kv[self.n : self.n + m, 0] = key_states.permute(2, 0, 1, 3)
        self.kv[self.n : self.n + m, 1] = value_states.permute(2, 0, 1, 3)
        self._keep(self.n + m)
        return self.keys, self.values

    def packed(self) -> torch.Tensor:
        """This rank's K/V for the layer as one contiguous (tokens, 2, B, Hkv, D) tensor."""
        return self.kv[: self.n]

    def get_seq_length(self) -> int:
        return self.layout.seq_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.layout.seq_length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self):
        self.kv, self.n, self.keys, self.values, self.is_initialized = None, 0, None, None, False

    def _keep(self, n: int):
        self.n = n
        if self.kv is not None:
            self.keys, self.values = self.kv[:n, 0].permute(1, 2, 0, 3), self.kv[:n, 1].permute(1, 2, 0, 3)

    def _map_batch(self, fn):
        if self.kv is not None:
            self.kv = fn(self.kv[: self.n]).contiguous()
            self._keep(self.n)

    def reorder_cache(self, beam_idx):
        self._map_batch(lambda kv: kv.index_select(2, beam_idx.to(kv.device)))

    def batch_repeat_interleave(self, repeats: int):
        self._map_batch(lambda kv: kv.repeat_interleave(repeats, dim=2))

    def batch_select_indices(self, indices):
        self._map_batch(lambda kv: kv[:, :, indices])

    def crop(self, tokens_to_remove: int):  # the cache crops all layers at once, see ShardedCache.crop
        raise NotImplementedError


class ShardedCache(Cache):
    """The KV cache of one context-parallel rank. Create it through `apply_context_parallel`'s hooks."""

    def __init__(self, num_layers: int, rank: int, world: int):
        self.layout = ShardLayout(rank, world)
        super().__init__(layers=[ShardedLayer(self.layout) for _ in range(num_layers)])

    @property
    def local_length(self) -> int:
        """Tokens stored on this rank per layer (for the sequence holding the most here)."""
        return self.layout.counts()[self.layout.rank]

    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        self.layout.map_rows(lambda c: c.index_select(0, beam_idx.cpu()))

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        self.layout.map_rows(lambda c: c.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices):
        super().batch_select_indices(indices)
        self.layout.map_rows(lambda c: c[indices.cpu()] if isinstance(indices, torch.Tensor) else c[indices])

    def local_nbytes(self) -> int:
        return sum(layer.n * layer.kv[0].numel() * layer.kv.element_size() for layer in self.layers if layer.kv is not None)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest tokens: a negative count removes that many, a positive one is the length to keep."""
        length = self.layout.seq_length
        keep = tokens_to_remove if tokens_to_remove >= 0 else length + tokens_to_remove
        keep = max(0, min(length, keep))
        # 1D columns are ascending, so a prefix survives; per-sequence tables just empty the slots
        self.layout.cols = [c[c < keep] if c.dim() == 1 else c.masked_fill(c >= keep, -1) for c in self.layout.cols]
        self.layout.seq_length = keep
        for layer in self.layers:
            layer._keep(self.layout.slots(self.layout.rank))
