"""One rank's execution of a forward plan (`Step`) and one attention layer's call within it (`LayerStep`).

The runtime's hooks build a `Step` per forward; the attention adapter makes a `LayerStep` per layer from it
(`Step.at`) and hands that to the algorithm, so nothing of one layer (its index, its sinks, how its K/V blocks
unpack) is written onto the object every layer shares. The simulated ranks of `hf_contextpar.tools.selftest.simulated`
build both too, to run the attention algorithms without a model or a process group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from ..cache.blocks import unpack_kv
from ..cache.layers import ChainedLayer
from ..cache.states import is_recurrent
from ..comm.collectives import Comm
from ..plan.context import ForwardContext
from ..plan.forward import ForwardPlan
from .masks import Chunked, classify

if TYPE_CHECKING:
    from ..cache.sharded import ShardedCache
    from ..sparse.csa import SparseRun


@dataclass
class LayerKV:
    """How the running layer's K/V blocks (as cached and sent) become the keys and values it attends with."""

    key_dim: int | None = None  # keys and values of different head sizes: where a block splits
    expand: Callable | None = None  # latent KV: the module's expand_kv(cached_k, cached_v) -> (k, v)
    local: tuple | None = None  # latent KV: this rank's block as the model expanded it itself
    width: int | None = None  # one head size for all of q, k, v (the fused kernels need it): zero-pad to it
    out_dim: int | None = None  # the values' head size, where it is narrower than `width`

    def pad(self, t: torch.Tensor) -> torch.Tensor:
        """Zero columns up to `width`: they add nothing to a dot product, and an output's are cut off."""
        short = (self.width or 0) - t.shape[-1]
        return torch.nn.functional.pad(t, (0, short)) if short > 0 else t


@dataclass
class Step:
    """One rank's execution of a plan: what every attention layer of the forward shares."""

    plan: ForwardPlan
    comm: Comm
    cache: ShardedCache | None
    num_layers: int
    state: dict = field(default_factory=dict)  # what an algorithm carries from one layer to the next
    attended: set = field(default_factory=set)  # layers whose attention ran in this forward (once each)
    sources: set = field(default_factory=set)  # the cache layers whose K/V those layers attended
    # per attention layer, the geometry of its K/V blocks (packing, KV heads, head size), as the attention adapter
    # saw them in earlier forwards: the runtime keeps one dict for the model's life, so an algorithm can post
    # receives ahead (the adapter writes it, an algorithm only reads it)
    kv_shapes: dict = field(default_factory=dict)
    # DCP: the TP peers holding this rank's KV head, each every dcp-th slot of the CP rank's columns (the
    # cache's ShardLayout.held); the algorithms see only this rank's slots, the adapter merges the peers'
    dcp: Comm | None = None
    sparse: SparseRun | None = None  # the approximate mode's settings (CSA), where one was asked for
    # indexed attention (DSA)'s layers: their indexer scores every column (attention/indexed.py); empty: none
    indexed: frozenset = frozenset()
    # what the model's family needs of the engine beyond its config (model/families.FamilyHooks, filled by patches/):
    # the adapter and the indexed attention ask it; None where no model runs (the simulated ranks)
    family: object = None
    # what this forward accumulates, shared with the cache (plan/context.py): the cache layers that stored (the K/V
    # they returned) and the received blocks this rank keeps; None where no cache runs (the simulated ranks)
    context: ForwardContext | None = None

    def __post_init__(self):
        self.windows = self.cache.windows if self.cache is not None else (None,) * self.num_layers
        self._held = {}  # window -> per rank: the key columns of the slots this rank holds (DCP)
        self._kinds = {}  # (rank, cache window, attention window) -> masks.classify of this forward's blocks

    def at(self, layer: int, kv_layer: int | None = None, *, sinks=None, kv: LayerKV | None = None) -> LayerStep:
        """Attention layer `layer`'s call, attending cache layer `kv_layer`'s K/V (its own by default), with its
        sinks and its K/V blocks' `LayerKV`: what the algorithm is handed."""
        return LayerStep(self, layer, layer if kv_layer is None else kv_layer, sinks, kv=kv or LayerKV())

    @property
    def algorithm(self) -> str:
        return self.plan.algorithm

    @property
    def q_cols(self) -> torch.Tensor:
        return self.plan.shards.q_cols[self.comm.rank]

    def cols(self, window) -> list:
        """Per rank: the key columns a layer of this cache window holds (a sliding layer keeps fewer; DCP: the slots
        this rank holds)."""
        return self.plan.shards.kv_cols_for(window) if self.dcp is None else self.held_cols(window)

    def kind(self, rank: int, cache_window, window) -> str | None:
        """`masks.classify` of this rank's queries against rank's keys of a layer of cache window `cache_window`
        under the attention window `window`, taken once per forward (`LayerStep.block_kind`)."""
        key = (rank, cache_window, window)
        if key not in self._kinds:
            q, k = self.q_cols, self.cols(cache_window)[rank]
            self._kinds[key] = classify(q, k, window) if q.numel() and k.shape[-1] and k.dim() == 1 else None
        return self._kinds[key]

    def held_cols(self, window) -> list:
        """DCP: per CP rank, the columns of the slots the rank at this DCP index holds. A sliding layer's
        columns start after the slots it dropped before this forward (the cache commits drops at the end)."""
        if window not in self._held:
            shards, layout = self.plan.shards, self.cache.layout if self.cache is not None else None
            index, size = self.dcp.rank, self.dcp.world
            held = []
            for r, cols in enumerate(shards.kv_cols_for(window)):
                base = layout.dropped[window][r] if window in shards.window_cols else 0
                slots = torch.arange(base, base + cols.shape[-1])
                held.append(cols[..., slots % size == index])
            self._held[window] = held
        return self._held[window]

    def chained_at(self, layer: int) -> bool:
        """Does `layer` pass a recurrent state down the ranks in this forward (a hybrid layer's, beside its K/V; a
        family's own `ChainedLayer`'s: DeepSeek-V4's compressors)?"""
        if not self.plan.chained or self.cache is None:
            return False
        return is_recurrent(self.cache.layers[layer]) or isinstance(self.cache.layers[layer], ChainedLayer)

    @property
    def padding(self):
        return self.plan.padding

    def batch_size(self, rank) -> int:
        return len(range(self.plan.batch)[self.plan.shards.seq_rows[rank]])

    @property
    def left_padding(self) -> torch.Tensor:
        """(B,) each sequence's leading padding tokens, on the CPU: where transformers starts counting its chunks."""
        if "left_padding" not in self.state:
            pad = self.plan.padding
            self.state["left_padding"] = (
                torch.zeros(self.plan.batch, dtype=torch.long) if pad is None else (pad.cumsum(-1) == 0).sum(-1).cpu()
            )
        return self.state["left_padding"]


@dataclass
class LayerStep:
    """One attention layer's call within a forward (`Step.at`): the `call.LayerCall` an algorithm reads. Made
    fresh for each layer and never changed (a variant is a `replace`), so no layer sees another's index, sinks or
    K/V geometry."""

    forward: Step
    layer: int  # index of the attention layer running now
    kv_layer: int  # the cache layer whose K/V it attends (another's where a model shares KV across layers)
    sinks: torch.Tensor | None = None  # the layer's attention sinks (H,), if the model has them
    wants_lse: bool = False  # the layer merges more after the algorithm (entries.py): decode returns its LSE
    kv: LayerKV = field(default_factory=LayerKV)  # how the layer's K/V blocks become keys and values

    def but(self, **changes) -> LayerStep:
        """The same call with some fields changed (DCP and the entries run the algorithm without the sinks)."""
        return replace(self, **changes)

    @property
    def comm(self) -> Comm:
        return self.forward.comm

    @property
    def state(self) -> dict:
        return self.forward.state

    @property
    def kv_shapes(self) -> dict:
        return self.forward.kv_shapes

    @property
    def dcp(self) -> Comm | None:
        return self.forward.dcp

    @property
    def sparse(self):
        return self.forward.sparse

    @property
    def padding(self):
        return self.forward.plan.padding

    @property
    def q_cols(self) -> torch.Tensor:
        return self.forward.q_cols

    @property
    def q_cols_all(self) -> list:
        return self.forward.plan.shards.q_cols

    @property
    def batch_rows(self):
        return self.forward.plan.shards.seq_rows

    @property
    def kv_cols(self) -> list:
        """Per rank: the key columns the layer holds (a sliding layer keeps fewer)."""
        return self.forward.cols(self.forward.windows[self.kv_layer])

    def unpack(self, block: torch.Tensor, src: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) to attend to from rank src's K/V block of the layer."""
        kv = self.kv
        if kv.local is not None and src == self.comm.rank:
            k, v = kv.local
        else:
            k, v = unpack_kv(block, kv.key_dim)
            if kv.expand is not None:
                k, v = kv.expand(k, v)
        return kv.pad(k), kv.pad(v)

    def out_shape(self, q: torch.Tensor) -> tuple:
        """The shape of the attention output for queries q: the values' head size, not the padded one."""
        return (*q.shape[:-1], self.kv.out_dim or q.shape[-1])

    def block_kind(self, rank: int, window) -> str | None:
        """`masks.classify` of this rank's queries against rank's keys of the layer under the attention window
        `window` (None where either side is empty, or for chunks: the kernel classifies those itself). The plan
        fixes both column sets for the whole forward, so every layer of one cache window and rule shares it: taken
        once per forward instead of once per layer (four tensor reads each, a decode step's main cost)."""
        if isinstance(window, Chunked):
            return None
        return self.forward.kind(rank, self.forward.windows[self.kv_layer], window)

    def kv_size(self, rank: int, layer: int | None = None) -> int:
        """Tokens in rank's block of the layer (or of `layer`): a message size."""
        window = self.forward.windows[self.kv_layer if layer is None else layer]
        if self.dcp is None:
            return self.forward.plan.shards.kv_size(rank, window)
        return self.forward.held_cols(window)[rank].shape[-1]

    def rebalance_span(self) -> tuple | None:
        """The new columns [lo, hi) the layer keeps of the blocks it receives (rebalancing, forward._rebalanced),
        where the layer stores its own K/V (not another's, shared); else None."""
        forward = self.forward
        store = forward.context.store if forward.context is not None else None
        if store is None or store.rebalance is None or forward.cache is None or self.kv_layer != self.layer:
            return None
        return store.rebalance[:2]

    def received(self, block: torch.Tensor, src: int) -> None:
        """An algorithm hands over rank src's K/V block of the layer as it arrives; the cache keeps what this rank
        commits of it (rebalancing, forward._rebalanced), through the forward's context. The algorithm itself
        writes nothing."""
        if src != self.comm.rank and self.rebalance_span() is not None:
            self.forward.context.arrive(self.kv_layer, block, self.kv_cols[src])

    def chained_at(self, layer: int) -> bool:
        return self.forward.chained_at(layer)

    def batch_size(self, rank) -> int:
        return self.forward.batch_size(rank)

    def key_valid(self, rank, rows=slice(None)):
        """(B, Tk) bool for rank's keys (rank None: this forward's own), padding = False; None if no padding."""
        padding = self.padding
        if padding is None:
            return None
        cols = self.q_cols if rank is None else self.kv_cols[rank]
        pad = padding[rows]
        if cols.dim() == 2:
            return pad.gather(1, cols[rows].clamp(min=0).to(pad.device))
        return pad[:, cols.to(pad.device)]
