"""A transformers `Cache` that holds only this rank's slice of the KV cache.

Each rank stores the K/V of the tokens it owns in one buffer per layer of shape (2, batch,
kv_heads, capacity, head_dim): every head's keys are contiguous rows, which is what the
attention kernels stream fastest (decode at 8K keys with head_dim 32: about twice as fast as
reading them out of a token-major buffer), and decode appends without re-concatenating. Where
keys and values differ in head size (MLA caches its latent as keys and the RoPE part as values)
the buffer is (1, batch, heads, capacity, key_dim + value_dim), split by `kernels.unpack_kv`. The
algorithms that send a shard send this layout too (`block`): straight from the buffer after a
first prefill, which sizes it exactly, else one contiguous copy per layer. The global columns of
every rank's tokens are replicated metadata (a few integers per token), so any rank can build
the mask for any other rank's block without asking for it. `get_seq_length()` reports the
*global* length, so `generate()` keeps its bookkeeping unchanged.

Sliding-window layers keep what transformers' `DynamicSlidingWindowLayer` keeps: once a forward is
committed, only keys a later query can still see (columns from length - window + 1 on), on every
rank; while `generate()` records the past (assisted decoding) everything stays until `crop`. The
cache has sliding layers exactly where the single-process cache would: `DynamicCache(config=...)`
(what a model makes when given no cache) has them, a config-less `DynamicCache()` does not.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .errors import CacheMismatchError, PatchStateError, UnsupportedModelError
from .kernels import unpack_kv
from .plan import window_drops
from .shard_layout import ShardLayout


def cache_argument(model) -> str:
    """The name `model.forward` takes its cache under: transformers 5.24 renamed `past_key_values` to
    `cache` (keeping the old name as a deprecated alias); remote-code models may still use the old one."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def returned_cache(output):
    """The cache a forward or `generate()` returned: `output.cache` from transformers 5.24 on, else
    `output.past_key_values` (read without the deprecation warning 5.24's alias logs)."""
    name = "cache" if "cache" in getattr(output, "__dataclass_fields__", {}) else "past_key_values"
    return getattr(output, name, None)


def cache_windows(cache: Cache) -> list:
    """Per layer of a transformers cache: its sliding window, or None for a layer that keeps every token."""
    return [
        getattr(layer, "sliding_window", None) if getattr(layer, "is_sliding", False) else None
        for layer in cache.layers
    ]


class ShardedLayer(CacheLayerMixin):
    is_croppable = True

    def __init__(self, layout: ShardLayout, window: int | None = None):
        super().__init__()
        self.layout = layout
        self.window, self.is_sliding = window, window is not None
        self.kv: torch.Tensor | None = None  # (2, B, Hkv, capacity, D), or (1, B, Hkv, capacity, Dk + Dv)
        self.key_dim: int | None = None  # where a joint (1, ...) buffer splits into keys and values
        self.first = 0  # buffer index of the oldest kept token (a sliding layer drops older ones)
        self.n = 0  # buffer index after the newest
        self.handed = False  # updated in the running forward (reset by ShardedCache.begin)

    # transformers' generate() switches past recording on and off on the layers that have it
    @property
    def record_past(self) -> bool:
        return self.layout.record_past

    @record_past.setter
    def record_past(self, value: bool):
        self.layout.record_past = bool(value)

    def activate_past_recording(self):
        self.layout.record_past = True

    def lazy_initialization(self, key_states, value_states):
        if key_states.shape[:-1] != value_states.shape[:-1]:
            raise UnsupportedModelError(
                "hf-contextpar packs K and V together and needs them to have the same batch, head and token "
                f"counts; this model has keys {tuple(key_states.shape)} and values {tuple(value_states.shape)}."
            )
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        if value_states.shape[-1] == d:
            self.kv = torch.empty((2, b, h, 0, d), dtype=self.dtype, device=self.device)
        else:  # keys and values of different head sizes share one buffer, side by side
            self.key_dim = d
            self.kv = torch.empty((1, b, h, 0, d + value_states.shape[-1]), dtype=self.dtype, device=self.device)
        self.first = 0
        self._keep(0)
        self.is_initialized = True

    def _reserve(self, n: int) -> int:
        """Make room up to buffer index n: grow the buffer, or first move the kept tokens to its start
        (a sliding layer's dropped ones leave room there). Returns how far the kept tokens moved down."""
        if n <= self.kv.shape[3]:
            return 0
        moved, live = self.first, self.live
        two, b, h, cap, d = self.kv.shape
        if n - moved > cap:  # grow (a sliding layer to twice what it holds: it drops as it appends)
            cap = max(2 * cap, n - moved, 64) if self.window is None else max(2 * (n - moved), 64)
        target = torch.empty((two, b, h, cap, d), dtype=self.kv.dtype, device=self.kv.device)
        target[:, :, :, :live] = self.kv[:, :, :, moved : self.n]
        self.kv, self.first = target, 0
        self._keep(live)
        return moved

    def dropped(self) -> int:
        """Leading slots of this rank's layout columns the layer no longer holds (as committed)."""
        return 0 if self.window is None else self.layout.dropped[self.window][self.layout.rank]

    def held_dropped(self) -> int:
        """Of those, the ones this rank held (all of them without DCP): buffer entries gone."""
        return self.layout.held(self.dropped())

    def trim(self, by: int):
        """Drop the `by` oldest tokens (a sliding layer, when a forward is committed or the cache
        cropped); a buffer left mostly empty is given back."""
        if self.kv is None:  # nothing stored yet
            return
        self.first += by
        live = self.live
        if self.kv.shape[3] > max(64, 4 * live):
            self.kv = self.kv[:, :, :, self.first : self.n].clone()  # the rest goes back to the allocator
            self.first = 0
        self._keep(self.first + live)

    def update(self, key_states, value_states, *args, **kwargs):
        store = self.layout.store
        if store is None:  # e.g. the stock model after remove_context_parallel: it would attend to 1/N of the keys
            raise PatchStateError(
                "this ShardedCache holds one rank's share of a context-parallel KV cache and works only with "
                "the patched model; after remove_context_parallel, start again without it (or with a new cache)."
            )
        if self.handed:
            raise UnsupportedModelError(
                "this model updates one cache layer twice in a forward; hf-contextpar's sharded cache stores each "
                "layer's new tokens once, so it cannot run under context parallelism."
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.handed = True
        if store.slots is not None:  # batched decode: one token for some sequences
            rows, slots = store.slots
            layout, base = self.layout, self.first - self.layout.held(self.dropped())
            n = max(self.n, base + layout.held(int(slots.max()) + 1)) if slots.numel() else self.n
            if layout.dcp_size > 1:  # DCP: only the slots this rank holds (key_states: one row per sequence)
                keep = layout.mine(slots)
                rows, slots = rows[keep], slots[keep]
                keep = keep.to(key_states.device)
                key_states, value_states = key_states[keep], value_states[keep]
            slots = base + layout.held(slots)  # layout slot -> buffer index
            moved = self._reserve(n)
            n, slots = n - moved, slots - moved
            self.kv[:, :, :, self.n : n] = 0  # new slots start empty; masked, but must hold finite values
            rows, slots = rows.to(self.kv.device), slots.to(self.kv.device)
            keys, values = unpack_kv(self.kv, self.key_dim)
            keys[rows, :, slots] = key_states[:, :, 0]
            values[rows, :, slots] = value_states[:, :, 0]
            self._keep(n)
            return self.keys, self.values
        if store.rows is not None and store.rows.numel() < key_states.shape[2]:
            if store.rows.numel() == 0:  # decode: this token is stored on another rank
                return self.keys, self.values
            rows = store.rows.to(key_states.device)  # ascending and distinct: all of them means every token
            key_states, value_states = key_states.index_select(2, rows), value_states.index_select(2, rows)
        if self.layout.dcp_size > 1:  # DCP: of the new slots (after the layout's), those this rank holds
            start = self.layout.slots(self.layout.rank)
            rows = torch.nonzero(self.layout.mine(torch.arange(start, start + key_states.shape[2]))).view(-1)
            rows = rows.to(key_states.device)
            key_states, value_states = key_states.index_select(2, rows), value_states.index_select(2, rows)
        m = key_states.shape[2]
        self._reserve(self.n + m)
        keys, values = unpack_kv(self.kv[:, :, :, self.n : self.n + m], self.key_dim)
        keys.copy_(key_states)
        values.copy_(value_states)
        self._keep(self.n + m)
        return self.keys, self.values

    def block(self) -> torch.Tensor:
        """This rank's K/V for the layer, (2, B, Hkv, tokens, D) (or the joint layout): a view of the buffer,
        contiguous (so it can be sent as it is) while the buffer holds exactly these tokens, as after a
        first prefill."""
        return self.kv[:, :, :, self.first : self.n]

    def get_seq_length(self) -> int:
        return self.layout.seq_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.layout.seq_length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self):
        self.kv, self.keys, self.values, self.is_initialized, self.key_dim = None, None, None, False, None
        self.first = self.n = 0

    @property
    def live(self) -> int:
        """Tokens this layer holds on this rank."""
        return self.n - self.first

    def nbytes(self) -> int:
        """Bytes of the K/V this layer holds on this rank."""
        two, b, h, _, d = self.kv.shape
        return self.live * two * b * h * d * self.kv.element_size()

    def _keep(self, n: int):
        self.n = n
        if self.kv is not None:
            self.keys, self.values = unpack_kv(self.kv[:, :, :, self.first : n], self.key_dim)

    def _map_batch(self, fn):
        if self.kv is not None:
            live = self.live
            self.kv, self.first = fn(self.kv[:, :, :, self.first : self.n]).contiguous(), 0
            self._keep(live)

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

    def __init__(self, num_layers: int, rank: int, world: int, windows=None):
        """windows: per layer, the sliding window its cache keeps (None: every token), as the
        single-process cache would have it (`cache_windows`)."""
        windows = list(windows) if windows else [None] * num_layers
        self.layout = ShardLayout(rank, world, windows)
        super().__init__(layers=[ShardedLayer(self.layout, w) for w in windows])

    @property
    def windows(self) -> tuple:
        return tuple(layer.window for layer in self.layers)

    @classmethod
    def bind(cls, cache: Cache, num_layers: int, rank: int, world: int) -> ShardedCache:
        """Turn the caller's empty cache object into this rank's ShardedCache, in place, with the
        sliding layers it was made with (DynamicCache(config=...) has them, DynamicCache() none)."""
        user_defined = getattr(cache, "_is_user_defined", None)
        windows = cache_windows(cache) if len(cache.layers) == num_layers else None
        recording = any(getattr(layer, "record_past", False) for layer in cache.layers)  # assisted decoding's
        cache.__dict__.clear()
        cache.__class__ = cls
        cls.__init__(cache, num_layers, rank, world, windows)
        cache.layout.record_past = recording
        if user_defined is not None:
            cache._is_user_defined = user_defined
        return cache

    # -- one forward: told the plan at the start, the layout committed at the end ----------------
    def begin(self, storage):
        self.layout.store = storage.store[self.layout.rank]
        for layer in self.layers:
            layer.handed = False
        self._sizes = [layer.live for layer in self.layers]

    def end(self, storage, ok: bool = True):
        """Commit the plan's layout (sliding layers drop what no later query sees); if the forward
        failed, forget what it stored."""
        self.layout.store = None
        if ok:
            before = [layer.held_dropped() for layer in self.layers]
            self.layout.commit(storage)
            self._trim(before)
        else:
            for layer, live in zip(self.layers, self._sizes):
                layer._keep(layer.first + live)

    def _trim(self, before: list):
        """Sliding layers drop what the layout dropped since `before` (per layer)."""
        for layer, was in zip(self.layers, before):
            layer.trim(layer.held_dropped() - was)

    @property
    def local_length(self) -> int:
        """Tokens stored on this rank per layer (for the sequence holding the most here)."""
        return self.layout.held_count()

    def local_nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers if layer.kv is not None)

    def sizing(self) -> list:
        """What sets this cache's message sizes besides the layout's columns: the sliding windows,
        past recording and what each window's layers dropped (a rank that cropped differently)."""
        return [*(w or 0 for w in self.windows), self.layout.record_past, *sum(self.layout.dropped.values(), [])]

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
        layout = self.layout
        keep = max(0, layout.seq_length + tokens_to_remove)
        # 1D columns are ascending, so a prefix survives; per-sequence tables just empty the slots
        cols = [c[c < keep] if c.dim() == 1 else c.masked_fill(c >= keep, -1) for c in layout.cols]
        drops = window_drops(cols, keep, layout.dropped)
        for w, dropped in layout.dropped.items():  # what DynamicSlidingWindowLayer.crop refuses
            if layout.seq_length >= w and not layout.record_past:
                raise RuntimeError(
                    "`crop` was called, but the current layer does not track past states, and the sliding window size "
                    "was already reached. Call `activate_past_recording` before `crop` to be able to rollback the cache."
                )
            if any(now < d for now, d in zip(drops[w], dropped)):
                raise CacheMismatchError(
                    f"crop({tokens_to_remove}) goes back further than this cache's sliding layers kept (window {w}): "
                    "the keys it would need again were already dropped. Activate past recording before the "
                    "tokens to be cropped are added, as transformers' assisted decoding does."
                )
        layout.cols, layout.seq_length = cols, keep
        layout.run = None  # the cropped tokens may have been the open run's: the next decode starts a new one
        for layer in self.layers:
            layer._keep(layer.first + layout.held(layout.slots(layout.rank)) - layer.held_dropped())
        before = [layer.held_dropped() for layer in self.layers]
        layout.dropped = drops
        self._trim(before)

    def reset(self):
        """Empty the cache, keeping the object (DynamicCache.reset)."""
        super().reset()
        dcp = self.layout.dcp_index, self.layout.dcp_size
        self.layout.__init__(self.layout.rank, self.layout.world, self.windows)
        self.layout.dcp_index, self.layout.dcp_size = dcp
