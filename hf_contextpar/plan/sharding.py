"""Which global token columns each rank owns.

Prefill uses Meta's load-balanced head-tail split (CP paper 3.5.1, vLLM PCP): the T new tokens
are cut into 2N near-equal chunks and rank i takes chunks i and 2N-1-i, so every rank gets the
same share of the causal triangle. Tokens that arrive while prompts are shorter than N (and
every decode token) are replicated on all ranks and *stored* on one rank, in runs of
`interleave` tokens starting on the least-loaded rank, so the shards never differ by more than
`interleave` tokens (one by default).
"""

from __future__ import annotations

import torch


def even_shares(num_tokens: int, counts: list[int]) -> list[int]:
    """How many of `num_tokens` new tokens each rank takes: floor or ceil of T/N, the extra ones
    going to the ranks that hold the fewest tokens (lowest rank on ties), so shards that were
    within one token of each other stay so, turn after turn."""
    world = len(counts)
    base, extra = divmod(num_tokens, world)
    by_load = sorted(range(world), key=lambda r: (counts[r], r))
    shares = [base] * world
    for r in by_load[:extra]:
        shares[r] += 1
    return shares


def head_tail_plan(num_tokens: int, world_size: int, counts: list[int] | None = None) -> list[torch.Tensor]:
    """Per rank, the ascending indices (0..num_tokens-1) of the new tokens it takes.

    The tokens are cut into 2N contiguous chunks laid out as head_0 .. head_{N-1}, tail_{N-1} ..
    tail_0, and rank i takes head_i and tail_i: chunks i and 2N-1-i. Rank i's share (see
    `even_shares`, given the tokens each rank already caches) is split evenly between its head
    and its tail, so every rank gets the same slice of the causal triangle.
    """
    shares = even_shares(num_tokens, counts or [0] * world_size)
    heads = [(s + 1) // 2 for s in shares]
    tails = [s - h for s, h in zip(shares, heads)]
    sizes = heads + tails[::-1]
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    plan = []
    for r in range(world_size):
        tail_chunk = 2 * world_size - 1 - r
        plan.append(
            torch.cat(
                [torch.arange(bounds[r], bounds[r + 1]), torch.arange(bounds[tail_chunk], bounds[tail_chunk + 1])]
            )
        )
    return plan


def decode_owners(num_tokens: int, counts, interleave: int = 1, run=None):
    """Place `num_tokens` new tokens (replicated decode) in runs of `interleave` tokens per rank
    (vLLM's cp_kv_cache_interleave_size). A run starts on the rank holding the fewest tokens
    (lowest rank on ties) and takes the following tokens until it holds `interleave` of them, or
    until one more would put its rank more than `interleave` tokens ahead of a sequence's smallest
    shard.

    counts: tokens per rank, or (batch, world) per sequence (after batched decode). `run` is the
    (rank, tokens placed) of the run the previous decode forward left open, or None. Returns (per
    rank, the indices of the new tokens it stores; the open run after them). With interleave 1
    every token goes to the least-loaded rank: round-robin once the shards are even, rebalancing
    them after an uneven prefill. Shards within `interleave` tokens of each other stay so.
    """
    # plain Python over the distinct rows (one while every sequence holds the same columns): this runs
    # before every decode step, where a dozen small tensor ops cost more than the arithmetic
    counts = counts.tolist() if isinstance(counts, torch.Tensor) else counts
    rows = [list(r) for r in {tuple(r) for r in counts}] if isinstance(counts[0], list) else [list(counts)]
    world = len(rows[0])
    owned: list[list[int]] = [[] for _ in range(world)]
    for t in range(num_tokens):
        if run is not None and run[1] < interleave and max(r[run[0]] - min(r) for r in rows) < interleave:
            run = (run[0], run[1] + 1)
        else:
            most = [max(r[rank] for r in rows) for rank in range(world)]
            run = (most.index(min(most)), 1)  # the first of equal minima
        owned[run[0]].append(t)
        for r in rows:
            r[run[0]] += 1
    return [_indices(o) for o in owned], run


_NONE, _FIRST = torch.empty(0, dtype=torch.long), torch.zeros(1, dtype=torch.long)


def _indices(owned: list[int]) -> torch.Tensor:
    """A rank's token indices as a tensor; a decode step's (none, or its one token) shared, never written to
    (plans and layouts are read only), as building two tensors a step costs more than placing the token."""
    return _NONE if not owned else _FIRST if owned == [0] else torch.tensor(owned, dtype=torch.long)


def partition_sizes(num_tokens: int, ratios) -> list[int]:
    """Contiguous partition sizes for `num_tokens` from fractions `ratios` (any positive weights).

    Sizes are cumulative roundings, so they sum to num_tokens exactly; when there are at least as
    many tokens as ranks every rank gets one or more (a rank with nothing to compute would only
    add a hop to the chain)."""
    weights = [max(float(r), 0.0) for r in ratios]
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"partition ratios must have a positive sum, got {list(ratios)}")
    bounds, acc = [0], 0.0
    for w in weights:
        acc += w
        bounds.append(round(num_tokens * acc / total))
    sizes = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    if num_tokens >= len(sizes):
        for r in range(len(sizes)):
            while sizes[r] == 0:
                donor = max(range(len(sizes)), key=sizes.__getitem__)
                sizes[donor] -= 1
                sizes[r] += 1
    return sizes


def contiguous_plan(sizes: list[int]) -> list[torch.Tensor]:
    """Per rank, the indices of its contiguous chunk: rank i takes the i-th `sizes[i]` tokens."""
    plan, start = [], 0
    for size in sizes:
        plan.append(torch.arange(start, start + size))
        start += size
    return plan


def window_drops(cols, length: int, windows) -> dict:
    """Per window, per rank: the leading slots of `cols` no query of a sequence `length` long sees.
    A forward only appends columns, so this never falls below what was dropped before; `crop` checks."""
    return {w: [droppable(c, length - w + 1) for c in cols] for w in windows}


def droppable(cols: torch.Tensor, line: int) -> int:
    """Leading slots of a rank's key columns that hold nothing at or after column `line`. 1D columns
    ascend. In a per-sequence table a sequence's next decode token goes right after its last filled
    slot, so its empty slots (-1) there must stay; an empty slot before a filled one (a later prefill
    appended to every sequence) is never filled. A slot goes when it is old or such a hole in every sequence."""
    if line <= 0 or cols.shape[-1] == 0:
        return 0
    if cols.dim() == 1:
        return int((cols < line).sum())
    filled = cols >= 0
    slot = torch.arange(cols.shape[1])
    last = torch.where(filled, slot, -1).amax(1, keepdim=True)
    gone = (filled & (cols < line)) | (~filled & (slot < last))
    return int(gone.all(0).cumprod(0).sum())


def rank_counts(cols) -> list[int]:
    """Tokens per rank (the most any one sequence holds there)."""
    return [int((c >= 0).sum(-1).max()) if c.dim() == 2 else c.numel() for c in cols]


def rank_tokens(cols, batch: int):
    """`decode_owners`' counts: tokens per rank as plain ints while every rank's columns are 1D (every
    sequence alike: replicated decode, before every step, where building a tensor only to read it back
    costs more than the count), else `sequence_counts`."""
    if all(c.dim() == 1 for c in cols):
        return [c.numel() for c in cols]
    return sequence_counts(cols, batch)


def sequence_counts(cols, batch: int) -> torch.Tensor:
    """(batch, world): how many tokens of each sequence every rank stores (one op while every rank's
    columns are 1D, as in replicated decode, where this runs before every step)."""
    if all(c.dim() == 1 for c in cols):
        return torch.tensor([[c.numel() for c in cols]]).expand(batch, -1)
    return torch.stack([(c >= 0).sum(-1) if c.dim() == 2 else torch.full((batch,), c.numel()) for c in cols], 1)
