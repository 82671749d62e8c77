"""The layers of a `ShardedCache`: one rank's share of an attention layer's K/V, and a hybrid layer's.

`ShardedLayer` holds the K/V of the tokens this rank owns in one buffer of shape (2, batch, kv_heads,
capacity, head_dim) (see sharded.py for why); `ShardedHybridLayer` is transformers' hybrid layer
(`LinearAttentionAndFullAttentionLayer`: a layer whose block runs attention and a recurrent mixer
side by side, Falcon-H1 and Zamba's) with that K/V: its conv / recurrent states are transformers'
own, whole on every rank. `ChainedLayer` is the interface of a family's own chained layer (patches/), made by a
`ChainedLayerFactory`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin, LinearAttentionLayer

from ..errors import PatchStateError, UnsupportedModelError
from ..plan.layout import ShardLayout
from .blocks import unpack_kv


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
        self.cache_index: int | None = None  # its index among its cache's layers (set by ShardedCache)
        self.context = None  # the running forward's plan/context.ForwardContext (ShardedCache.begin); None between

    # Qwen4-Exp's QSA keeps the whole sequence's position ids on its first indexed layer and reads query positions
    # as the last of them: inside a patched forward, every column's (global order) through the forward's context's
    # position history (attention/indexed.py `History`), this rank's share stored with the index keys; what the model
    # writes back is checked, never stored
    @property
    def indexer_position_ids(self):
        indexer = self.context.indexer if self.context is not None else None
        return indexer.history() if indexer is not None else None

    @indexer_position_ids.setter
    def indexer_position_ids(self, value):
        indexer = self.context.indexer if self.context is not None else None
        if indexer is None:
            raise PatchStateError(
                "this ShardedCache holds one rank's share of a context-parallel cache and works only with the "
                "patched model; after remove_context_parallel, start again without it (or with a new cache)."
            )
        indexer.history.check(value)

    def update_index(self, keys: torch.Tensor) -> torch.Tensor:
        """transformers' per-layer form of the cache's `update_indexer` (MiniMax-M3's sparse layers call it on their
        cache layer): one head of index keys (B, 1, T_new, D) in, every column's (B, 1, T, D) out in global order,
        through the running forward's indexer (attention/indexed.py), so the model's own block top-k is one
        process's. Only inside a patched forward."""
        indexer = self.context.indexer if self.context is not None else None
        if indexer is None or keys.dim() != 4 or keys.shape[1] != 1:
            raise PatchStateError(
                f"update_index of index keys {tuple(keys.shape)} on a context-parallel cache: it takes one head "
                "(B, 1, T, D), inside the patched model's forward (after remove_context_parallel, start again "
                "without this cache)."
            )
        return indexer.cache.update_indexer(keys[:, 0], self.cache_index).unsqueeze(1)

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
        if self.kv is None or (by == 0 and self.kv.shape[3] <= max(64, 4 * self.live)):  # nothing to drop or give back
            return  # (every change of the buffer already took its views: _keep)
        self.first += by
        live = self.live
        if self.kv.shape[3] > max(64, 4 * live):
            self.kv = self.kv[:, :, :, self.first : self.n].clone()  # the rest goes back to the allocator
            self.first = 0
        self._keep(self.first + live)

    def update(self, key_states, value_states, *args, **kwargs):
        """Store this rank's share of the layer's new K/V (the running forward's `store`) and return every key and
        value it holds; the forward's context records what it returned (the adapter attends exactly that)."""
        context = self.context
        if context is None or context.store is None:  # e.g. the stock model after remove_context_parallel: it
            raise PatchStateError(  # would attend to 1/N of the keys
                "this ShardedCache holds one rank's share of a context-parallel KV cache and works only with "
                "the patched model; after remove_context_parallel, start again without it (or with a new cache)."
            )
        if self.cache_index in context.stored:
            raise UnsupportedModelError(
                "this model updates one cache layer twice in a forward; hf-contextpar's sharded cache stores each "
                "layer's new tokens once, so it cannot run under context parallelism."
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._store(key_states, value_states, context.store)
        context.stored[self.cache_index] = (self.keys, self.values)
        return self.keys, self.values

    def _store(self, key_states, value_states, store):
        """Keep the rows `store` (a forward.RankCommit) says this rank keeps: a batched decode's slots, or some or
        all of its new tokens (under DCP those of its slots)."""
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
            return
        if store.rows is not None and store.rows.numel() < key_states.shape[2]:
            if store.rows.numel() == 0:  # decode: this token is stored on another rank
                return
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

    def rebalance(self, lo: int, hi: int, start: int, added: int, arrived: list):
        """End of a rebalanced prefill: of this forward's `added` own tokens (columns from `start` on) keep those
        in [lo, hi), with the received ones this rank kept (`arrived`: ForwardContext.arrive's (first column, K/V))
        in column order, where its own tokens were: what the layer held before stays in place (no copy of the
        whole cache)."""
        if self.kv is None:  # a layer this model never filled (another layer holds its K/V)
            return
        base = self.n - added  # buffer index of this forward's first own token
        a, b = max(lo, start) - start, min(hi, start + added) - start
        ahead = sum(kv.shape[3] for col, kv in arrived if col < start)  # received columns before its own
        pieces = list(arrived)
        if b > a:  # its kept tokens, copied only if they move
            own = self.kv[:, :, :, base + a : base + b]
            pieces.append((start + a, own if ahead == a else own.clone()))
        if sum(kv.shape[3] for _, kv in pieces) != hi - lo:
            raise PatchStateError(
                f"rebalancing the K/V expected columns {lo}..{hi} from this rank and the blocks it received; this "
                "layer's attention did not run the planned algorithm. Please report this model."
            )
        base -= self._reserve(base + hi - lo)
        at = base
        for _, kv in sorted(pieces, key=lambda p: p[0]):
            if kv.data_ptr() != self.kv[:, :, :, at:].data_ptr():  # its own tokens where they already are: stay
                self.kv[:, :, :, at : at + kv.shape[3]] = kv
            at += kv.shape[3]
        self._keep(at)

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


class ShardedHybridLayer(LinearAttentionLayer, ShardedLayer):
    """A hybrid layer: this rank's share of the K/V (ShardedLayer) beside the layer's whole conv and
    recurrent states (transformers' LinearAttentionLayer), as `LinearAttentionAndFullAttentionLayer` joins them."""

    is_compileable = False  # as transformers' hybrid layer (generate() would prepare 4D masks for a compileable cache)

    def __init__(self, layout: ShardLayout, window: int | None, number_of_states: int):
        ShardedLayer.__init__(self, layout, window)
        recording = layout.record_past
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)
        layout.record_past = recording  # its __init__ sets record_past False: the layout's, shared by every layer

    def lazy_initialization(self, *args, **kwargs) -> None:
        if len(args) == 2 and not kwargs:  # the K/V's update
            ShardedLayer.lazy_initialization(self, *args)
        else:  # update_conv_state / update_recurrent_state
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def reset(self) -> None:
        LinearAttentionLayer.reset(self)
        ShardedLayer.reset(self)

    def reorder_cache(self, beam_idx):
        LinearAttentionLayer.reorder_cache(self, beam_idx)
        ShardedLayer.reorder_cache(self, beam_idx)

    def get_max_length(self) -> int:
        return -1


class ChainedLayer(ShardedLayer):
    """A family's own cache layer (patches/: DeepSeek-V4's compressors) whose states pass down the ranks in prefill
    beside its K/V, as a recurrent layer's do. The library reads it through these four methods alone."""

    @abstractmethod
    def chained_states(self) -> list[dict]:
        """Its states after the forward, for `states.share_final_states` (whole on every rank for decode)."""

    @abstractmethod
    def load_chained_states(self, states: list[dict]) -> None:
        """The states `chained_states` gave on the root rank."""

    @abstractmethod
    def remember(self) -> None:
        """At a forward's start (`ShardedCache.begin`): keep its states for `end_forward`."""

    @abstractmethod
    def end_forward(self, ok: bool) -> None:
        """At a forward's end (`ShardedCache.end`): a failed forward's states dropped, as the K/V's are."""


class LayerMaker(ABC):
    """One entry of the contract's per-layer recurrence list (`sharded.cache_recurrence`): the maker of this rank's
    cache layer, which ranks and forwards compare (equal when they make the same layer: a frozen dataclass's
    equality). `states`: the layer has states that pass down the ranks' chain in a prefill (recurrent.py); `kv`: it
    holds K/V its attention reads."""

    states: bool = False
    kv: bool = True

    @abstractmethod
    def __call__(self, layout: ShardLayout, window: int | None) -> CacheLayerMixin: ...


@dataclass(frozen=True)
class KVOnly(LayerMaker):
    """A layer of K/V alone: this rank's share of it (`ShardedLayer`)."""

    def __call__(self, layout: ShardLayout, window: int | None) -> ShardedLayer:
        return ShardedLayer(layout, window)


@dataclass(frozen=True)
class Recurrent(LayerMaker):
    """A linear-attention, state-space or convolution layer (transformers' own, whole on every rank) with
    `number_of_states` states; `kv`: a hybrid layer (Falcon-H1's, Zamba's) that holds K/V too."""

    number_of_states: int
    kv: bool = False
    states: bool = True

    def __call__(self, layout: ShardLayout, window: int | None) -> CacheLayerMixin:
        if self.kv:
            return ShardedHybridLayer(layout, window, self.number_of_states)
        return LinearAttentionLayer(number_of_states=self.number_of_states)


class ChainedLayerFactory(LayerMaker):
    """What `sharded.FAMILY_LAYERS` makes of a template cache layer: the maker of this rank's `ChainedLayer` (a
    family's own layer of K/V and states, DeepSeek-V4's compressors)."""

    states = True

    @abstractmethod
    def __call__(self, layout: ShardLayout, window: int | None) -> ChainedLayer: ...
