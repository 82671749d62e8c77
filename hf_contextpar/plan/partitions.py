"""KV-Runahead's context partitions (KVR paper 4.2): even (KVR-E), searched (KVR-S), predicted (KVR-P),
and balanced by measured work (`balanced` + `MeasuredWork`: the default for KV-Runahead and for every
chain, since even partitions leave the last rank the most attention and the others waiting for it).

In the KV-Runahead chain a later rank attends to a longer prefix and waits longer for it, so
TTFT is lowest when earlier ranks take more tokens. `search` finds the partition by the paper's
hierarchical grid search on measured TTFT: boundaries start at the even split, every boundary is
moved over a small grid with a coarse stride, the best point is kept and the stride halves
until it reaches the minimum. `PartitionTable` stores searched partitions as ratios per context
length and predicts a partition for any length by linear interpolation between the two nearest
entries (clamped to the end entries outside the table). `python -m hf_contextpar kvr-table`
builds and saves one for a model and N on the running machine.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import math
from dataclasses import dataclass, field

from .sharding import partition_sizes


def even(num_tokens: int, world: int) -> list[int]:
    """KVR-E: contiguous partitions of equal size, within a token of each other (rounded bounds)."""
    return partition_sizes(num_tokens, [1.0] * world)


def balanced(num_tokens: int, world: int, past: int, per_token: float, per_pair: float) -> list[int]:
    """Contiguous partitions of equal predicted work (KV-Runahead's and a chain's default): a token costs `per_token`
    (its linear layers) plus `per_pair` per key it attends to (past + its index + 1), so later partitions,
    whose queries see more keys, take fewer tokens. The work up to token t is a t + b (P t + t (t + 1) / 2);
    each boundary is where it reaches k / N of the whole. Even partitions where that leaves one under 2 tokens."""

    def work(t: float) -> float:
        return per_token * t + per_pair * (past * t + t * (t + 1) / 2)

    total, bounds = work(num_tokens), [0]
    for k in range(1, world):
        lo, hi = bounds[-1], num_tokens  # the smallest t with work(t) >= k / N of the whole
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if work(mid) < total * k / world else (lo, mid)
        bounds.append(lo)
    sizes = [b - a for a, b in zip(bounds, [*bounds[1:], num_tokens])]
    return sizes if min(sizes) >= 2 else even(num_tokens, world)


def weighted(num_tokens: int, world: int, per_token: float, per_pair: float, weights) -> list[int]:
    """`_weighted`, remembered: a pure function of its arguments, which a CSA prefill's plan asks for every forward
    (its bisection costs about as much as the rest of the plan)."""
    return list(_weighted(num_tokens, world, per_token, per_pair, tuple(tuple(map(float, w)) for w in weights)))


@functools.lru_cache(maxsize=256)
def _weighted(num_tokens: int, world: int, per_token: float, per_pair: float, weights: tuple) -> tuple:
    """Contiguous partitions of a fresh prompt of equal predicted work where rank d's queries see the keys of an
    earlier rank s at weight `weights[s][d]` (CSA: the fraction of them its pruning keeps, averaged over the
    layers; all 1 is `balanced` with no past) and their own causally: rank d's work is
    n_d per_token + per_pair (n_d (n_d + 1) / 2 + n_d sum_s weights[s][d] n_s). For a common work W each n_d
    follows from the ones before it (a quadratic), and the total grows with W: W is bisected until the
    sizes sum to the prompt. Even partitions where that leaves one under 2 tokens."""

    def sizes(work: float) -> list[float]:
        out = []
        for d in range(world):
            lin = per_token + per_pair * (0.5 + sum(weights[s][d] * n for s, n in enumerate(out)))
            out.append(2 * work / (lin + math.sqrt(lin * lin + 2 * per_pair * work)))  # the quadratic's root
        return out

    lo, hi = 0.0, world * (per_token * num_tokens + per_pair * num_tokens * (num_tokens + 1) / 2)
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(sizes(mid)) < num_tokens else (lo, mid)
        if hi - lo <= 1e-12 * hi:
            break
    cut = partition_sizes(num_tokens, sizes(hi)) if num_tokens >= world and hi > 0 else []
    return tuple(cut if cut and min(cut) >= 2 else even(num_tokens, world))


def key_pairs(start: int, end: int, past: int) -> int:
    """Keys the queries of tokens [start, end) of a forward over `past` cached tokens see: the work
    `balanced`'s attention term counts."""
    return (end - start) * past + (end * (end + 1) - start * (start + 1)) // 2


class MeasuredWork:
    """`balanced`'s two costs as measured: the model's own (a token's linear layers, a key its queries
    see) scaled to the ranks' busy times (compute, waits excluded) in the latest partitioned prefills.

    The model's per-token term holds the linear layers alone, and a recurrent layer's scan (a chunked
    reference kernel on CPU, a fused one on GPU) costs what no FLOP count says: on the hybrid bench
    model the model alone gave rank 0 of 2 64% of a 16K prompt, the measured times about 60%. Every
    rank fits the same rows (all-gathered), so every rank cuts the same partitions."""

    def __init__(self, keep: int = 16):
        self.rows: list[tuple[float, float, float]] = []  # (model's token term, model's key term, seconds busy)
        self.keep = keep

    def add(self, rows):
        self.rows = (self.rows + [tuple(map(float, r)) for r in rows])[-self.keep :]

    def scales(self) -> tuple[float, float]:
        """(a, b) minimising sum (a x + b y - t)^2 over the rows, both positive; one common scale where the
        rows cannot tell the two apart; (1, 1) before any measurement."""
        if not self.rows:
            return 1.0, 1.0
        xx = sum(x * x for x, _, _ in self.rows)
        yy = sum(y * y for _, y, _ in self.rows)
        xy = sum(x * y for x, y, _ in self.rows)
        xt = sum(x * t for x, _, t in self.rows)
        yt = sum(y * t for _, y, t in self.rows)
        det = xx * yy - xy * xy
        if det > 1e-9 * xx * yy:
            a, b = (xt * yy - yt * xy) / det, (yt * xx - xt * xy) / det
            if a > 0 and b > 0:
                return a, b
        common = sum(t for _, _, t in self.rows) / max(sum(x + y for x, y, _ in self.rows), 1e-30)
        return common, common


@dataclass
class PartitionTable:
    """Searched partition ratios per context length, for one N. Predicts partitions (KVR-P)."""

    world: int
    entries: dict = field(default_factory=dict)  # context length -> ratios (sum 1)
    details: dict = field(default_factory=dict)

    def add(self, length: int, sizes: list[int]):
        if len(sizes) != self.world:
            raise ValueError(f"a partition for {self.world} ranks needs {self.world} sizes, got {sizes}")
        self.entries[int(length)] = [s / sum(sizes) for s in sizes]

    def ratios(self, length: int) -> list[float]:
        if not self.entries:
            raise ValueError("the partition table is empty; build it with `python -m hf_contextpar kvr-table`.")
        keys = sorted(self.entries)
        i = bisect.bisect_left(keys, length)
        if i == 0 or (i < len(keys) and keys[i] == length):
            return list(self.entries[keys[i if i < len(keys) else -1]])
        if i == len(keys):
            return list(self.entries[keys[-1]])
        lo, hi = keys[i - 1], keys[i]
        w = (length - lo) / (hi - lo)
        return [(1 - w) * a + w * b for a, b in zip(self.entries[lo], self.entries[hi])]

    def sizes(self, length: int, world: int) -> list[int]:
        """KVR-P: the interpolated partition of `length` tokens (exact integer sizes)."""
        if world != self.world:
            raise ValueError(
                f"this partition table was built for {self.world} ranks, not {world}; "
                "build one for this N with `python -m hf_contextpar kvr-table`."
            )
        return partition_sizes(length, self.ratios(length))

    def save(self, path: str) -> str:
        with open(path, "w") as f:
            json.dump(
                dict(
                    world=self.world, entries={str(k): v for k, v in sorted(self.entries.items())}, details=self.details
                ),
                f,
                indent=1,
            )
        return path

    @classmethod
    def load(cls, source) -> PartitionTable:
        """From a PartitionTable, a dict (as saved) or a JSON path."""
        if isinstance(source, cls):
            return source
        if not isinstance(source, dict):
            with open(source) as f:
                source = json.load(f)
        return cls(
            int(source["world"]),
            {int(k): list(v) for k, v in source["entries"].items()},
            dict(source.get("details", {})),
        )


def search(num_tokens: int, world: int, measure, points: int = 5, min_stride: int | None = None):
    """KVR-S: hierarchical grid search of the partition minimising `measure(sizes) -> seconds`.

    The world-1 inner boundaries start at the even split; each round tries `points` positions per
    boundary (stride apart, centred on the best so far), keeps the best and halves the stride,
    down to `min_stride` tokens (default: about 1% of the context). Every measured partition is
    remembered, so the even split counts as a candidate and the result is never slower than it
    in these measurements. Returns (best sizes, best seconds, {sizes: seconds}).
    """
    if num_tokens < world:
        raise ValueError(f"cannot partition {num_tokens} tokens over {world} ranks")
    min_stride = max(1, min_stride or num_tokens // 100)
    measured: dict[tuple, float] = {}

    def timed(bounds) -> float:
        sizes = tuple(b - a for a, b in zip((0, *bounds), (*bounds, num_tokens)))
        if sizes not in measured:
            measured[sizes] = measure(list(sizes))
        return measured[sizes]

    best = tuple(itertools.accumulate(even(num_tokens, world)))[:-1]
    timed(best)
    stride = max(min_stride, num_tokens // (2 * world))
    offsets = [k - points // 2 for k in range(points)]
    while True:
        for deltas in itertools.product(offsets, repeat=world - 1):
            bounds = tuple(b + d * stride for b, d in zip(best, deltas))
            if all(a < b for a, b in zip((0, *bounds), (*bounds, num_tokens))):
                timed(bounds)
        best_sizes = min(measured, key=measured.get)
        best = tuple(itertools.accumulate(best_sizes))[:-1]
        if stride <= min_stride:
            break
        stride = max(min_stride, stride // 2)
    best_sizes = min(measured, key=measured.get)
    return list(best_sizes), measured[best_sizes], measured
