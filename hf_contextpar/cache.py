"""A transformers `Cache` that holds only this rank's slice of the KV cache.

Each rank stores the K/V of the tokens it owns in one buffer per layer of shape (2, batch,
kv_heads, capacity, head_dim): every head's keys are contiguous rows, which is what the
attention kernels stream fastest (decode at 8K keys with head_dim 32: about twice as fast as
reading them out of a token-major buffer), and decode appends without re-concatenating. The
algorithms that send a shard send this layout too (`block`): straight from the buffer after a
first prefill, which sizes it exactly, else one contiguous copy per layer. The global columns of
every rank's tokens are replicated metadata (a few integers per token), so any rank can build
the mask for any other rank's block without asking for it. `get_seq_length()` reports the
*global* length, so `generate()` keeps its bookkeeping unchanged.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .errors import ContextParallelError
from .plan import rank_counts, sequence_counts


class ShardLayout:
    """Which global columns every rank stores; shared by all layers of one cache.

    cols[r] is 1D while every sequence holds the same columns on rank r (prefill, replicated
    decode), and becomes a (batch, slots) table once batched pass-Q decode has placed each
    sequence's tokens on different ranks (-1 marks an empty slot). The layout changes only when
    a forward ends (`commit`), to what that forward's plan said.
    """

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.cols: list[torch.Tensor] = [torch.empty(0, dtype=torch.long) for _ in range(world)]
        self.seq_length = 0  # committed global length (tokens of finished forwards)
        self.rotation = -1  # offset of the latest batched decode step (sequence b ran on rank (b + offset) % N)
        self.run = None  # the decode run left open (plan.ForwardPlan.run), continued by the next decode step
        self.store = None  # the running forward's plan.Store for this rank; None between forwards

    def commit(self, plan):
        self.cols, self.seq_length, self.rotation, self.run = (
            list(plan.kv_cols),
            plan.seq_length,
            plan.rotation,
            plan.run,
        )

    def slots(self, rank: int) -> int:
        return self.cols[rank].shape[-1]

    def sequence_counts(self, batch: int) -> torch.Tensor:
        """(batch, world): how many tokens of each sequence every rank stores."""
        return sequence_counts(self.cols, batch)

    def counts(self) -> list[int]:
        """Tokens per rank (the most any one sequence holds there)."""
        return rank_counts(self.cols)

    def map_rows(self, fn):
        """Apply a batch reordering (beam search, batch selection) to per-sequence column tables."""
        self.cols = [fn(c) if c.dim() == 2 else c for c in self.cols]


class ShardedLayer(CacheLayerMixin):
    is_sliding = False
    is_croppable = True

    def __init__(self, layout: ShardLayout):
        super().__init__()
        self.layout = layout
        self.kv: torch.Tensor | None = None  # (2, B, Hkv, capacity, D)
        self.n = 0

    def lazy_initialization(self, key_states, value_states):
        if key_states.shape != value_states.shape:
            raise ContextParallelError(
                "hf-contextpar packs K and V together and needs them to have the same shape; "
                f"this model has keys {tuple(key_states.shape)} and values {tuple(value_states.shape)}."
            )
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        self.kv = torch.empty((2, b, h, 0, d), dtype=self.dtype, device=self.device)
        self.n = 0
        self.is_initialized = True

    def _reserve(self, n: int):
        if n > self.kv.shape[3]:
            two, b, h, cap, d = self.kv.shape
            grown = torch.empty((two, b, h, max(2 * cap, n, 64), d), dtype=self.kv.dtype, device=self.kv.device)
            grown[:, :, :, : self.n] = self.kv[:, :, :, : self.n]
            self.kv = grown

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        store = self.layout.store
        if store is not None and store.slots is not None:  # batched decode: one token for some sequences
            rows, slots = store.slots
            n = max(self.n, int(slots.max()) + 1) if slots.numel() else self.n
            self._reserve(n)
            self.kv[:, :, :, self.n : n] = 0  # new slots start empty; masked, but must hold finite values
            rows, slots = rows.to(self.kv.device), slots.to(self.kv.device)
            self.kv[0, rows, :, slots] = key_states[:, :, 0]
            self.kv[1, rows, :, slots] = value_states[:, :, 0]
            self._keep(n)
            return self.keys, self.values
        if store is not None and store.rows is not None:
            rows = store.rows.to(key_states.device)
            key_states, value_states = key_states.index_select(2, rows), value_states.index_select(2, rows)
        m = key_states.shape[2]
        self._reserve(self.n + m)
        self.kv[0, :, :, self.n : self.n + m] = key_states
        self.kv[1, :, :, self.n : self.n + m] = value_states
        self._keep(self.n + m)
        return self.keys, self.values

    def block(self) -> torch.Tensor:
        """This rank's K/V for the layer, (2, B, Hkv, tokens, D): a view of the buffer, contiguous (so it
        can be sent as it is) while the buffer holds exactly these tokens, as after a first prefill."""
        return self.kv[:, :, :, : self.n]

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
            self.keys, self.values = self.kv[0, :, :, :n], self.kv[1, :, :, :n]

    def _map_batch(self, fn):
        if self.kv is not None:
            self.kv = fn(self.kv[:, :, :, : self.n]).contiguous()
            self._keep(self.n)

    def reorder_cache(self, beam_idx):
        self._map_batch(lambda kv: kv.index_select(1, beam_idx.to(kv.device)))

    def batch_repeat_interleave(self, repeats: int):
        self._map_batch(lambda kv: kv.repeat_interleave(repeats, dim=1))

    def batch_select_indices(self, indices):
        self._map_batch(lambda kv: kv[:, indices])

    def crop(self, tokens_to_remove: int):  # all layers share one layout: ShardedCache.crop does them together
        raise NotImplementedError("crop the ShardedCache, not one of its layers")


class ShardedCache(Cache):
    """The KV cache of one context-parallel rank. Created by `apply_context_parallel`'s hooks, or
    bound in place to the empty `DynamicCache` a caller passes (`bind`), so a cache object the
    caller keeps and passes again carries the sharded state, as it would on one process."""

    def __init__(self, num_layers: int, rank: int, world: int):
        self.layout = ShardLayout(rank, world)
        super().__init__(layers=[ShardedLayer(self.layout) for _ in range(num_layers)])

    @classmethod
    def bind(cls, cache: Cache, num_layers: int, rank: int, world: int) -> ShardedCache:
        """Turn the caller's empty cache object into this rank's ShardedCache, in place."""
        user_defined = getattr(cache, "_is_user_defined", None)
        cache.__dict__.clear()
        cache.__class__ = cls
        cls.__init__(cache, num_layers, rank, world)
        if user_defined is not None:
            cache._is_user_defined = user_defined
        return cache

    # -- one forward: told the plan at the start, the layout committed at the end ----------------
    def begin(self, plan):
        self.layout.store = plan.store[self.layout.rank]
        self._sizes = [layer.n for layer in self.layers]

    def end(self, plan, ok: bool = True):
        """Commit the plan's layout; if the forward failed, forget what it stored."""
        self.layout.store = None
        if ok:
            self.layout.commit(plan)
        else:
            for layer, n in zip(self.layers, self._sizes):
                layer._keep(n)

    @property
    def local_length(self) -> int:
        """Tokens stored on this rank per layer (for the sequence holding the most here)."""
        return self.layout.counts()[self.layout.rank]

    def local_nbytes(self) -> int:
        return sum(
            layer.n * layer.kv[:, :, :, 0].numel() * layer.kv.element_size()
            for layer in self.layers
            if layer.kv is not None
        )

    # -- the Cache API generate() and the models use, with DynamicCache's semantics --------------
    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        self.layout.map_rows(lambda c: c.index_select(0, beam_idx.cpu()))

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        self.layout.map_rows(lambda c: c.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices):
        super().batch_select_indices(indices)
        self.layout.map_rows(lambda c: c[indices.cpu()] if isinstance(indices, torch.Tensor) else c[indices])

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the newest `-tokens_to_remove` tokens, as DynamicCache does (0 removes nothing;
        a positive count, the legacy absolute length, is refused as DynamicCache refuses it)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                "Please use a negative integer to remove that number of tokens from the cache instead."
            )
        keep = max(0, self.layout.seq_length + tokens_to_remove)
        # 1D columns are ascending, so a prefix survives; per-sequence tables just empty the slots
        self.layout.cols = [c[c < keep] if c.dim() == 1 else c.masked_fill(c >= keep, -1) for c in self.layout.cols]
        self.layout.seq_length = keep
        self.layout.run = None  # the cropped tokens may have been the open run's: the next decode starts a new one
        for layer in self.layers:
            layer._keep(self.layout.slots(self.layout.rank))

    def reset(self):
        """Empty the cache, keeping the object (DynamicCache.reset)."""
        super().reset()
        self.layout.__init__(self.layout.rank, self.layout.world)
