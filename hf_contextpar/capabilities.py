"""The capability record: what the engine runs beside plain attention, each capability owned by one room.

A capability is something a model or the settings may use that the algorithms must be told of and that refuses
what it cannot run exactly: moving whole heads (attention/ulysses.py), indexed attention (DSA, attention/indexed.py),
the recurrent state chain (cache/recurrent.py), the approximate mode (CSA, sparse/csa.py). Its room holds its
checks, its refusals and its hooks; this record lists the rooms' apply-time checks, which apply runs once, in this
order, with the agreed facts (`Facts`: the same on every rank, so every rank refuses alike, before any forward).
What a check returns is what the forwards read of the capability (falsy: the model does not use it), kept as
`PatchedModel.capabilities[name]` (patched.py).

A new capability is its own room and one entry here; its refusals at run time are its room's functions, which the
room it hooks into (the adapter, the cache) calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import mesh
from .attention import indexed, ulysses
from .cache import recurrent
from .model.families import hooks_of
from .sparse import csa


@dataclass(frozen=True)
class Facts:
    """What a capability's check reads at apply, agreed by every rank."""

    model: object
    settings: object  # the agreed Settings
    world: int  # context-parallel ranks
    tp: int  # tensor-parallel ranks per CP rank
    dcp: tuple | None  # (group, index, size) of the TP ranks sharing this rank's KV head, or None
    shape: object  # the cost model's Shape of the model (model/shape.py)
    recurrent: bool  # the model has recurrent layers (the contract's reading of its cache)

    @property
    def config(self):
        return self.model.config

    @property
    def hooks(self):
        """What the model's family needs of the engine beyond its config (`FamilyHooks`, model/families.py)."""
        return hooks_of(self.model.config)


@dataclass(frozen=True)
class Capability:
    name: str
    check: Callable[[Facts], object]  # raises the capability's refusal; returns what the forwards read of it


RECORD: dict[str, Capability] = {
    c.name: c
    for c in (
        Capability("tensor_parallel", mesh.check),
        Capability("whole_heads", ulysses.check),
        Capability("indexed", indexed.check),
        Capability("chain", recurrent.check),
        Capability("csa", csa.check),
    )
}


def check(facts: Facts) -> dict:
    """Every capability's check, in the record's order: name -> what the forwards read of it."""
    return {name: capability.check(facts) for name, capability in RECORD.items()}
