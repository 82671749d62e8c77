"""What an attention algorithm may read of the forward it runs in: `LayerCall`.

An algorithm is `fn(step: LayerCall, q, kv_local, *, scale, window, softcap) -> (out, LSE)`. `LayerStep`
(step.py, one per layer, made by `Step.at`) is the one implementation; it reaches more (the forward's `Step`:
the plan, the cache, the forward's context), which an algorithm does not touch: it returns (out, LSE) and hands
received blocks to `received`, and the cache and the runtime do their own bookkeeping. tests/unit/test_layout.py checks that
every algorithm file reads only these names of its step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from ..comm.collectives import Comm


class LayerCall(Protocol):
    comm: Comm  # this rank's communicator: rank, world, the sends and receives (byte-counted)
    layer: int  # the attention layer running now
    sinks: torch.Tensor | None  # its attention sinks (H,) or (B, H, Tq), for the algorithms that merge them themselves
    state: dict  # what an algorithm carries from one layer to the next within a forward
    kv_shapes: dict  # per layer, its K/V block geometry seen in earlier forwards (read only: to post receives ahead)
    dcp: Comm | None  # DCP's peers sharing this KV head (decode keeps its LSE for their merge)
    wants_lse: bool  # the layer merges more after the algorithm (attention/entries.py): decode keeps its LSE too
    padding: torch.Tensor | None  # (B, global length) bool, False on padding; None: nothing padded
    q_cols: torch.Tensor  # this rank's query columns
    q_cols_all: list  # every rank's query columns
    kv_cols: list  # per rank: the key columns its block of the running layer holds
    batch_rows: list  # batched decode: per rank, the slice of sequences it runs
    sparse: object  # an approximate mode's settings (sparse/csa.SparseRun), or None

    def kv_size(self, rank: int, layer: int | None = None) -> int: ...  # tokens in rank's block: a message size

    def key_valid(self, rank, rows=slice(None)) -> torch.Tensor | None: ...  # (B, Tk) for rank's keys

    def block_kind(
        self, rank: int, window
    ) -> str | None: ...  # masks.classify of the queries vs rank's keys, per forward

    def unpack(self, block: torch.Tensor, src: int) -> tuple[torch.Tensor, torch.Tensor]: ...  # (k, v) to attend

    def out_shape(self, q: torch.Tensor) -> tuple: ...  # the output's shape for queries q

    def received(self, block: torch.Tensor, src: int) -> None: ...  # a block arrived: the cache keeps its share

    def chained_at(self, layer: int) -> bool: ...  # does `layer` pass a recurrent state down the ranks too

    def batch_size(self, rank: int) -> int: ...  # batched decode: how many sequences rank runs


MEMBERS = frozenset(n for n in LayerCall.__annotations__) | frozenset(
    n for n, v in vars(LayerCall).items() if isinstance(v, Callable) and not n.startswith("_")
)
