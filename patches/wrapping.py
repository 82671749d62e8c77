"""Counted, reversible wrapping of transformers' code, for the patches that wrap a modeling module's function or a
mixer class's method (mamba1.py, gated_delta.py).

The wrapper goes in once per (owner, name), however many models are patched, and comes out with the last
model's undo, unless something else was put there since (a user's own kernel), which is left in place.
"""

from __future__ import annotations

_installed: dict = {}  # (owner, name) -> [original, models patched, wrapper]


def install(owner, name: str, wrap):
    """Replace owner.name by wrap(original) (once per owner and name, counted); returns undo()."""
    entry = _installed.setdefault((owner, name), [getattr(owner, name), 0, None])
    if entry[1] == 0:
        entry[2] = wrap(entry[0])
        setattr(owner, name, entry[2])
    entry[1] += 1

    def undo():
        entry[1] -= 1
        if entry[1] == 0:
            if getattr(owner, name) is entry[2]:
                setattr(owner, name, entry[0])
            del _installed[owner, name]

    return undo


def original(owner, name: str):
    """What owner.name was before it was wrapped (for measuring a patch against its absence)."""
    return _installed[owner, name][0]


def wrapped() -> list[tuple]:
    """The (owner, name) pairs wrapped now."""
    return list(_installed)
