"""Many context-parallel groups in one launch: data-parallel replicas x CP (x TP).

An eval of many long prompts runs fastest as several CP groups at once, each near its N-fold limit, each taking
its share of the requests (4 replicas of CP 2 on 8 devices rather than one CP group of 8). The layout is the one
accelerate's `ParallelismConfig` describes, read where users already write it: the object an `Accelerator` holds,
or the `PARALLELISM_CONFIG_*` environment (`ParallelismConfig()` reads the same variables), or a `cp_size` given
to a tool (lm-eval's `hf-cp`). Ranks are numbered in accelerate's mesh order (dp_replicate, dp_shard, cp, sp, tp:
TP innermost), so rank r = (replica * cp + c) * tp + t: a TP group is tp consecutive ranks (one node's devices
under torchrun), a CP group takes one rank of each TP group of its replica, and the `across` group of a rank
holds the ranks of the same (c, t) in every replica (what a tool gathers its replicas' results over).

Inference has no use for accelerate's distinction between replicated and sharded data parallelism (FSDP shards
weights for training): both are replicas here. Its `cp_backend` (training CP, PyTorch's) is not this library's
and is ignored, said once; `sp_size` (DeepSpeed's Ulysses) is refused: Ulysses is `strategy="ulysses"` here.
accelerate itself refuses `dp_replicate_size` > 1 with `cp_size` > 1 (a training rule: CP needs FSDP), so the
environment is read here, not through `ParallelismConfig()`.
"""

from __future__ import annotations

import datetime
import os
import sys
import warnings
from dataclasses import dataclass

import torch.distributed as dist

from ..errors import ContextParallelError

_ENV = "PARALLELISM_CONFIG_"
_SIZES = ("dp_replicate", "dp_shard", "cp", "sp", "tp")


@dataclass(frozen=True)
class Replicas:
    """`count` replicas of a CP group of `cp` ranks, each rank of which is a TP group of `tp` ranks."""

    count: int
    cp: int
    tp: int = 1

    @classmethod
    def of(cls, world: int, cp: int | None = None, tp: int = 1) -> Replicas:
        """The layout of `world` ranks with CP groups of `cp` (default: all the ranks TP leaves), checked."""
        if tp < 1 or world % tp:
            raise ContextParallelError(f"tp={tp} must divide the number of processes ({world}).")
        cp = world // tp if cp is None else cp
        if cp < 1 or world % (cp * tp):
            raise ContextParallelError(
                f"cp_size={cp} x tp={tp} must divide the number of processes ({world}): the processes split into "
                f"replicas of cp_size x tp ranks each (e.g. cp_size={world // tp} for one replica)."
            )
        return cls(world // (cp * tp), cp, tp)

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(replica, CP rank, TP rank) of a global rank."""
        return rank // (self.cp * self.tp), rank // self.tp % self.cp, rank % self.tp

    def cp_ranks(self, replica: int, t: int) -> list[int]:
        return [(replica * self.cp + c) * self.tp + t for c in range(self.cp)]

    def across_ranks(self, c: int, t: int) -> list[int]:
        return [(replica * self.cp + c) * self.tp + t for replica in range(self.count)]


@dataclass
class ReplicaGroups:
    """This rank's groups: its replica's CP group (None: a CP group of one), the ranks of its (c, t) in every
    replica (None: one replica), and which replica it is in."""

    cp: object
    across: object
    replica: int
    layout: Replicas


def make_groups(layout: Replicas, timeout: float | None = None, *, across: bool = True) -> ReplicaGroups:
    """Every rank makes every group, in one order (`new_group` is a collective of the whole world); the across
    groups only where asked (a tool gathering between replicas; a model needs its CP group alone)."""
    td = datetime.timedelta(seconds=timeout) if timeout is not None else None
    kwargs = dict(timeout=td) if td is not None else {}
    replica, c, t = layout.coordinates(dist.get_rank())
    mine_cp = mine_across = None
    for r in range(layout.count):
        for tt in range(layout.tp):
            group = dist.new_group(layout.cp_ranks(r, tt), **kwargs)
            if (r, tt) == (replica, t):
                mine_cp = group
    for cc in range(layout.cp if across else 0):
        for tt in range(layout.tp):
            group = dist.new_group(layout.across_ranks(cc, tt), **kwargs)
            if (cc, tt) == (c, t):
                mine_across = group
    return ReplicaGroups(mine_cp if layout.cp > 1 else None, mine_across if layout.count > 1 else None, replica, layout)


def accelerate_layout(world: int) -> Replicas | None:
    """The layout an accelerate `ParallelismConfig` describes (the `Accelerator`'s object, else the environment),
    checked against the world; None where there is none."""
    sizes, backend = _accelerator_sizes() or _environment_sizes()
    if sizes is None:
        return None
    if sizes["sp"] > 1:
        raise ContextParallelError(
            f"the accelerate parallelism config sets sp_size={sizes['sp']} (DeepSpeed's Ulysses sequence "
            "parallelism, for training); hf-contextpar runs Ulysses as a strategy of its CP group: set cp_size "
            "instead and pass strategy='ulysses'."
        )
    if backend not in (None, "torch") or sizes["cp"] > 1:
        warnings.warn(
            "the accelerate parallelism config's cp_backend (PyTorch's training CP) is ignored: its cp_size sets "
            "hf-contextpar's CP groups.",
            stacklevel=3,
        )
    total = sizes["dp_replicate"] * sizes["dp_shard"] * sizes["cp"] * sizes["tp"]
    if total != world:
        raise ContextParallelError(
            f"the accelerate parallelism config describes {total} processes (dp_replicate {sizes['dp_replicate']} x "
            f"dp_shard {sizes['dp_shard']} x cp {sizes['cp']} x tp {sizes['tp']}) and {world} were launched: make "
            "them equal."
        )
    return Replicas.of(world, sizes["cp"], sizes["tp"])


def _environment_sizes() -> tuple[dict | None, str | None]:
    if not any(f"{_ENV}{name.upper()}_SIZE" in os.environ for name in _SIZES):
        return None, None
    sizes = {}
    for name in _SIZES:
        text = os.environ.get(f"{_ENV}{name.upper()}_SIZE", "1")
        if not text.isdigit() or int(text) < 1:
            raise ContextParallelError(f"{_ENV}{name.upper()}_SIZE={text!r}: it must be a positive number.")
        sizes[name] = int(text)
    return sizes, os.environ.get(f"{_ENV}CP_BACKEND")


def _accelerator_sizes() -> tuple[dict, str | None] | None:
    """The sizes of the parallelism config an `Accelerator` was made with, if accelerate made one (never
    importing accelerate, nor making its state)."""
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "AcceleratorState", None), "_shared_state", None) or {}
    config = shared.get("parallelism_config") if hasattr(shared, "get") else None
    if config is None:
        return None
    sizes = {name: int(getattr(config, f"{name}_size", 1) or 1) for name in _SIZES}
    return sizes, getattr(config, "cp_backend", None)
