"""Which global token columns each rank owns.

Prefill uses Meta's load-balanced head-tail split (CP paper 3.5.1, vLLM PCP): the T new tokens
are cut into 2N near-equal chunks and rank i takes chunks i and 2N-1-i, so every rank gets the
same share of the causal triangle. Tokens that arrive while prompts are shorter than N (and
every decode token) are replicated on all ranks and *stored* on the least-loaded rank, so the
shards never differ by more than one token.
"""

from __future__ import annotations

import torch


def chunk_bounds(num_tokens: int, num_chunks: int) -> list[int]:
    """Boundaries of `num_chunks` near-equal chunks of `num_tokens` (the first ones get the extras)."""
    base, extra = divmod(num_tokens, num_chunks)
    bounds = [0]
    for j in range(num_chunks):
        bounds.append(bounds[-1] + base + (1 if j < extra else 0))
    return bounds


def head_tail_indices(num_tokens: int, world_size: int, rank: int) -> torch.Tensor:
    """Ascending indices (0..num_tokens-1) of the new tokens rank `rank` takes: chunks r and 2N-1-r."""
    b = chunk_bounds(num_tokens, 2 * world_size)
    head = torch.arange(b[rank], b[rank + 1])
    tail_chunk = 2 * world_size - 1 - rank
    tail = torch.arange(b[tail_chunk], b[tail_chunk + 1])
    return torch.cat([head, tail])


def head_tail_plan(num_tokens: int, world_size: int) -> list[torch.Tensor]:
    """`head_tail_indices` for every rank."""
    return [head_tail_indices(num_tokens, world_size, r) for r in range(world_size)]


def least_loaded_owners(num_tokens: int, counts: list[int]) -> list[torch.Tensor]:
    """Place `num_tokens` new tokens one at a time on the rank holding the fewest (lowest rank on ties).

    Returns, per rank, the indices of the new tokens it stores. `counts` is not modified.
    This is round-robin once the shards are level, and it levels them after an uneven prefill.
    """
    counts = list(counts)
    owned: list[list[int]] = [[] for _ in counts]
    for t in range(num_tokens):
        r = min(range(len(counts)), key=counts.__getitem__)
        owned[r].append(t)
        counts[r] += 1
    return [torch.tensor(o, dtype=torch.long) for o in owned]
