"""The conversations a server keeps: each one's tokens and its sharded KV cache, reused by the next request that
extends them.

Meta's persistent-KV multi-turn (seed 000, section 3.3): a chat's next turn, or a completions prompt that
extends an earlier one, prefills only its new tokens over the kept cache (the planner picks pass-KV or pass-Q
for them, Alg. 5). Matching is on tokens, never strings: a history re-tokenised by the chat template may differ
from what was generated at the seams, so the longest common prefix is what is reused.

Every rank holds the same table of conversations (ids, tokens, order) over its own share of each cache. Only
rank 0 decides (`Conversations.plan`): which conversation a request reuses and how much of it, which ones go
to keep the KV within budget. The decision travels in the request's `Call`, and every rank applies it
(`Conversations.take`, `evict`, `keep`), so the ranks' tables never differ.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

from ...cache.recurrent import is_recurrent


@dataclasses.dataclass
class Reuse:
    """What a request reuses: conversation `key`'s first `tokens` tokens (`crop`: its cache drops the rest)."""

    key: int
    tokens: int
    crop: int = 0


@dataclasses.dataclass
class Footprint:
    """Bytes of KV a conversation holds on a rank: `fixed` (recurrent states, buffers of a set size) plus
    `per_token` for each token. Measured before the first request (`Lockstep.measure`: two short prompts) and
    raised by every kept cache, so a request's need is known before anything runs, its first included."""

    fixed: float = 0.0
    per_token: float = 0.0

    def need(self, tokens: int) -> float:
        return self.fixed + self.per_token * tokens

    def learn(self, tokens: int, nbytes: int) -> None:
        if tokens:
            self.per_token = max(self.per_token, (nbytes - self.fixed) / tokens)


@dataclasses.dataclass
class Entry:
    tokens: list[int]
    cache: object
    nbytes: int


class Conversations:
    """Kept conversations, least recently used first, within `budget` bytes of KV on this rank."""

    def __init__(self, budget: int):
        self.budget = budget
        self.entries: OrderedDict[int, Entry] = OrderedDict()
        self.next_key = 0
        self.footprint = Footprint()  # rank 0's: the estimate of a request's KV (every rank's share is alike)

    def plan(self, ids: list[int], max_new_tokens: int) -> tuple[Reuse | None, list[int]]:
        """Rank 0: the reuse (the longest common prefix with a kept conversation, leaving at least one token to
        prefill) and the conversations to evict so the KV stays within budget with this request's."""
        best, best_len = None, 0
        for key, entry in self.entries.items():
            n = _common_prefix(entry.tokens, ids)
            if n > best_len and _croppable(entry, n):
                best, best_len = key, n
        reuse = None
        if best is not None:
            reuse = Reuse(best, best_len, crop=best_len - len(self.entries[best].tokens))
        need = self.footprint.need(len(ids) + max_new_tokens)
        held = sum(e.nbytes for k, e in self.entries.items() if reuse is None or k != reuse.key)
        evict = []
        for key, entry in self.entries.items():  # oldest first
            if held + need <= self.budget:
                break
            if reuse is not None and key == reuse.key:
                continue
            evict.append(key)
            held -= entry.nbytes
        return reuse, evict

    def evict(self, keys: list[int]) -> None:
        for key in keys:
            self.entries.pop(key, None)

    def take(self, reuse: Reuse | None):
        """The cache a request continues (cropped to the reused prefix), out of the table; None: a new one."""
        if reuse is None:
            return None
        entry = self.entries.pop(reuse.key)
        if reuse.crop:
            entry.cache.crop(reuse.crop)
        return entry.cache

    def keep(self, tokens: list[int], cache, nbytes: int) -> int:
        """A finished request's conversation (its prompt and answer as far as the cache holds them), newest."""
        key, self.next_key = self.next_key, self.next_key + 1
        self.entries[key] = Entry(tokens, cache, nbytes)
        self.footprint.learn(len(tokens), nbytes)
        return key

    def fits(self, tokens: int) -> bool:
        """Whether a request of this many tokens (prompt and new) fits the budget alone: one that does not is
        refused before it runs (its KV would evict every conversation and still not fit)."""
        return self.footprint.need(tokens) <= self.budget

    def room(self) -> int | None:
        """The most tokens a request may hold within the budget (None: no estimate yet)."""
        fp = self.footprint
        return int((self.budget - fp.fixed) / fp.per_token) if fp.per_token > 0 else None

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Tokens `a` and `b` share from the start, at most len(b) - 1 (a request prefills at least one token)."""
    n = min(len(a), len(b) - 1)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return max(n, 0)


def _croppable(entry: Entry, n: int) -> bool:
    """Whether a kept cache can go back to its first n tokens: always where n is all of it; otherwise only without
    sliding layers (which dropped keys) and recurrent layers (whose state is the whole sequence's), as
    transformers' own crop allows. The same answer on every rank: the caches' structure is replicated."""
    if n == len(entry.tokens):
        return True
    layers = getattr(entry.cache, "layers", ())
    windows = getattr(entry.cache, "windows", ())
    return not any(windows) and not any(is_recurrent(layer) for layer in layers)
