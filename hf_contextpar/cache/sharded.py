"""A transformers `Cache` that holds only this rank's slice of the KV cache.

Each rank stores the K/V of the tokens it owns in one buffer per layer of shape (2, batch,
kv_heads, capacity, head_dim): every head's keys are contiguous rows, which is what the
attention kernels stream fastest (decode at 8K keys with head_dim 32: about twice as fast as
reading them out of a token-major buffer), and decode appends without re-concatenating. Where
keys and values differ in head size (MLA caches its latent as keys and the RoPE part as values)
the buffer is (1, batch, heads, capacity, key_dim + value_dim), split by `blocks.unpack_kv`. The
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

The layers (layers.py) are where the single-process cache has them too: `ShardedLayer` for
K/V, transformers' own `LinearAttentionLayer` for a recurrent layer's states (whole on every rank,
passed down the ranks in prefill by the `ChainedStates` mixin, recurrent.py), `ShardedHybridLayer`
for a layer with both.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..errors import CacheMismatchError, PatchStateError
from ..plan.context import ForwardContext
from ..plan.layout import ShardLayout
from ..plan.sharding import window_drops
from .layers import ChainedLayer, ChainedLayerFactory, KVOnly, LayerMaker, Recurrent, ShardedLayer
from .recurrent import ChainedStates
from .states import is_recurrent

__all__ = [
    "ShardedCache",
    "ShardedLayer",
    "cache_aliases",
    "cache_argument",
    "cache_recurrence",
    "cache_windows",
    "is_empty_cache",
    "returned_cache",
]


def cache_argument(model) -> str:
    """The name `model.forward` takes its cache under: transformers 5.24 renamed `past_key_values` to
    `cache` (keeping the old name as a deprecated alias); remote-code models may still use the old one."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_aliases(model) -> tuple:
    """The deprecated names `model.forward` (a model or its class) still takes its `cache` under (transformers'
    `deprecate_kwarg` wrappers: `past_key_values` for most families, `cache_params` for Mamba2's): a name it
    does not alias lands in its **kwargs and is ignored on one process, so it must be ignored here too."""
    names, f = [], (model if isinstance(model, type) else type(model)).forward
    while f is not None:
        try:
            scope = inspect.getclosurevars(f).nonlocals
        except TypeError:  # not a plain function (a partial, a callable object): no alias there
            scope = {}
        if scope.get("new_name") == "cache" and isinstance(scope.get("old_name"), str):
            names.append(scope["old_name"])
        f = getattr(f, "__wrapped__", None)
    return tuple(names)


def returned_cache(output):
    """The cache a forward or `generate()` returned: `output.cache` from transformers 5.24 on, else
    `output.past_key_values` (read without the deprecation warning 5.24's alias logs)."""
    name = "cache" if "cache" in getattr(output, "__dataclass_fields__", {}) else "past_key_values"
    return getattr(output, name, None)


def is_empty_cache(cache) -> bool:
    """No layer holds a token or a state (`get_seq_length` asks an attention layer, which Mamba2's cache lacks)."""
    return not any(
        (is_recurrent(layer) and any(layer.has_previous_state.values()))
        or (isinstance(layer, CacheLayerMixin) and layer.get_seq_length() > 0)
        for layer in cache.layers
    )


def cache_windows(cache: Cache) -> list:
    """Per layer of a transformers cache: its sliding window, or None for a layer that keeps every token."""
    return [
        getattr(layer, "sliding_window", None) if getattr(layer, "is_sliding", False) else None
        for layer in cache.layers
    ]


def with_copies(per_layer: list, copies) -> list:
    """A per-layer list of a config's layers, then the same for the copies of its layers a forward adds (by index,
    `FamilyHooks.cache_copies`): each copy is made, sized and sharded as its layer."""
    return [*per_layer, *(per_layer[i] for i in copies)]


# a family's own chained cache layer (patches/: DeepSeek-V4's compressors), by the transformers class it stands for:
# a function of that layer to its ChainedLayerFactory
FAMILY_LAYERS: dict = {}


def cache_recurrence(cache: Cache) -> list:
    """Per layer of a transformers cache: the `LayerMaker` of this rank's layer for it. A layer of K/V alone is
    `KVOnly`; linear-attention, state-space and convolution layers have states (`Recurrent`), a hybrid layer
    (Falcon-H1's, Zamba's) K/V too; a family's own chained layer (FAMILY_LAYERS) its factory."""
    return [_maker(layer) for layer in cache.layers]


def _maker(layer) -> LayerMaker:
    if type(layer) in FAMILY_LAYERS:
        return _family_factory(layer)
    if is_recurrent(layer):
        return Recurrent(layer.number_of_states, kv=isinstance(layer, CacheLayerMixin))
    return KVOnly()


def _family_factory(layer) -> ChainedLayerFactory:
    factory = FAMILY_LAYERS[type(layer)](layer)
    if not isinstance(factory, ChainedLayerFactory):
        raise PatchStateError(
            f"FAMILY_LAYERS[{type(layer).__name__}] made {factory!r}: a family's chained layer needs a "
            "ChainedLayerFactory (hf_contextpar/cache/layers.py)."
        )
    return factory


class ShardedCache(ChainedStates, Cache):
    """The KV cache of one context-parallel rank. Created by `apply_context_parallel`'s hooks, or
    bound in place to the empty `DynamicCache` a caller passes (`bind`), so a cache object the
    caller keeps and passes again carries the sharded state, as it would on one process. A model's
    recurrent layers keep transformers' own layers, whole on every rank; their states pass down the
    ranks' chain in a prefill (`ChainedStates`, recurrent.py)."""

    def __init__(self, num_layers: int, rank: int, world: int, windows=None, recurrence=None):
        """windows: per layer, the sliding window its cache keeps (None: every token), as the
        single-process cache would have it (`cache_windows`); recurrence: per layer, the `LayerMaker` of its
        layer (`cache_recurrence`; None: K/V alone in every layer)."""
        windows = list(windows) if windows else [None] * num_layers
        recurrence = list(recurrence) if recurrence else [KVOnly()] * num_layers
        self.layout = ShardLayout(rank, world, windows)
        super().__init__(layers=[make(self.layout, w) for w, make in zip(windows, recurrence)])
        self.kv_layers = [layer for layer in self.layers if isinstance(layer, ShardedLayer)]
        for i, layer in enumerate(self.layers):
            if isinstance(layer, ShardedLayer):
                layer.cache_index = i  # what it records its stores under in the running forward's context
        self._windows = tuple(getattr(layer, "window", None) for layer in self.layers)  # read every forward
        # indexed attention (DSA, attention/indexed.py): per layer, the index keys (B, held, D) of the columns this
        # rank holds (its layout's, in order), gathered whole for the indexer by the forward's (`update_indexer`)
        self.index_keys: dict = {}
        self.context: ForwardContext | None = None  # the running forward's (plan/context.py); None between forwards

    @property
    def windows(self) -> tuple:
        """Per layer, its sliding window (None: every token), fixed when the layers are made."""
        return self._windows

    @classmethod
    def bind(cls, cache: Cache, num_layers: int, rank: int, world: int, recurrence=None, copies=()) -> ShardedCache:
        """Turn the caller's empty cache object into this rank's ShardedCache, in place, with the
        sliding layers it was made with (DynamicCache(config=...) has them, DynamicCache() none) and
        the model's recurrent layers; `copies`: the layers its forward adds as copies of these
        (`FamilyHooks.cache_copies`), made now, each as its layer."""
        user_defined = getattr(cache, "_is_user_defined", None)
        windows = cache_windows(cache) if len(cache.layers) == num_layers - len(copies) else None
        windows = with_copies(windows, copies) if windows is not None else None
        recording = any(getattr(layer, "record_past", False) for layer in cache.layers)  # assisted decoding's
        cache.__dict__.clear()
        cache.__class__ = cls
        cls.__init__(cache, num_layers, rank, world, windows, recurrence)
        if recording:
            cache.activate_past_recording()
        if user_defined is not None:
            cache._is_user_defined = user_defined
        return cache

    # the global length, whichever layer is asked (transformers asks an attention layer, which Mamba2's cache
    # lacks; every layer shares the layout); 0 past the last layer, as Cache has it
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layout.seq_length if layer_idx < len(self.layers) else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return (self.layout.seq_length if layer_idx < len(self.layers) else 0) + query_length, 0

    # -- one forward: handed its context at the start, the layout committed at the end ----------------
    def begin(self, context: ForwardContext):
        """The forward `context` runs from now on: every K/V layer stores into it, and what the cache held before is
        kept in it, so a failed forward can be forgotten (`end`)."""
        self.context = context
        for layer in self.kv_layers:
            layer.context = context
            if isinstance(layer, ChainedLayer):  # a family's chained layer: its states as before, for a failure
                layer.remember()
        context.undo = ([layer.live for layer in self.kv_layers], dict(self.index_keys))

    def update_indexer(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """A DSA indexer's new keys (B, T_new, D) in; every column's (B, T, D) out, in global order, so its
        top-k is the one-process top-k (attention/indexed.py). Only inside a patched forward."""
        if self.context is None or self.context.indexer is None:
            raise PatchStateError(
                "this ShardedCache holds one rank's share of a context-parallel cache and works only with the "
                "patched model; after remove_context_parallel, start again without it (or with a new cache)."
            )
        if self.chain is not None:  # an exchange with every rank: the recurrent layer before it is done (Qwen4-Exp)
            self.chain.leave_layer()
        return self.context.indexer.gather(keys, layer_idx)

    def end(self, ok: bool = True):
        """Commit the running forward's plan's layout (sliding layers drop what no later query sees) and drop its
        context; if the forward failed, forget what it stored."""
        context, self.context = self.context, None
        for layer in self.kv_layers:
            layer.context = None
        sizes, index_before = context.undo
        rebalance = context.store.rebalance if context.store is not None else None
        if not ok:  # the index keys as they were before the forward
            self.index_keys = index_before
        if ok:
            before = [layer.held_dropped() for layer in self.kv_layers]
            self.layout.commit(context.plan.storage)
            for layer, live in zip(self.kv_layers, sizes) if rebalance is not None else ():  # even shares
                layer.rebalance(*rebalance, layer.live - live, context.arrived.get(layer.cache_index, []))
            self._trim(before)
        else:
            for layer, live in zip(self.kv_layers, sizes):
                layer._keep(layer.first + live)
        for layer in self.kv_layers:  # a family's chained layer: its states as they were if the forward failed
            if isinstance(layer, ChainedLayer):
                layer.end_forward(ok)

    def _trim(self, before: list):
        """Sliding layers drop what the layout dropped since `before` (per layer)."""
        for layer, was in zip(self.kv_layers, before):
            layer.trim(layer.held_dropped() - was)

    @property
    def local_length(self) -> int:
        """Tokens stored on this rank per layer (for the sequence holding the most here)."""
        return self.layout.held_count()

    def local_nbytes(self) -> int:
        kv = sum(layer.nbytes() for layer in self.kv_layers if layer.kv is not None)
        return kv + sum(k.numel() * k.element_size() for k in self.index_keys.values())

    @property
    def index_length(self) -> int:
        """Index keys (DSA) stored on this rank per indexer layer: the most any layer holds, 0 for none."""
        return max((k.shape[1] for k in self.index_keys.values()), default=0)

    def _map_index_keys(self, fn):
        self.index_keys = {layer: fn(k) for layer, k in self.index_keys.items()}

    def sizing(self) -> list:
        """What sets this cache's message sizes besides the layout's columns: the sliding windows,
        past recording and what each window's layers dropped (a rank that cropped differently)."""
        return [*(w or 0 for w in self.windows), self.layout.record_past, *sum(self.layout.dropped.values(), [])]

    # -- the Cache API generate() and the models use, with DynamicCache's semantics --------------
    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        self.layout.map_rows(lambda c: c.index_select(0, beam_idx.cpu()))
        self._map_index_keys(lambda k: k.index_select(0, beam_idx.to(k.device)))

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        self.layout.map_rows(lambda c: c.repeat_interleave(repeats, dim=0))
        self._map_index_keys(lambda k: k.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices):
        super().batch_select_indices(indices)
        self.layout.map_rows(lambda c: c[indices.cpu()] if isinstance(indices, torch.Tensor) else c[indices])
        self._map_index_keys(lambda k: k[indices.to(k.device)] if isinstance(indices, torch.Tensor) else k[indices])

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the newest `-tokens_to_remove` tokens, as DynamicCache does (0 removes nothing;
        a positive count, the legacy absolute length, is refused as DynamicCache refuses it)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                "Please use a negative integer to remove that number of tokens from the cache instead."
            )
        for layer in self.layers:  # first: a recurrent layer refuses unless it recorded its past (transformers')
            if is_recurrent(layer):
                layer.crop(tokens_to_remove)
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
        self._map_index_keys(lambda k: k[:, : cols[layout.rank].shape[-1]])  # ascending columns: a prefix survives
        layout.run = None  # the cropped tokens may have been the open run's: the next decode starts a new one
        for layer in self.kv_layers:
            layer._keep(layer.first + layout.held(layout.slots(layout.rank)) - layer.held_dropped())
        before = [layer.held_dropped() for layer in self.kv_layers]
        layout.dropped = drops
        self._trim(before)

    def reset(self):
        """Empty the cache, keeping the object (DynamicCache.reset)."""
        super().reset()
        self.index_keys = {}
        dcp = self.layout.dcp_index, self.layout.dcp_size
        self.layout.__init__(self.layout.rank, self.layout.world, self.windows)
        self.layout.dcp_index, self.layout.dcp_size = dcp
