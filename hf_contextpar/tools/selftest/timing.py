"""`selftest --simulated --timing`: the attention kernels and the merge at long lengths, against
unsharded SDPA on the same device.

Per length T, with N head-tail ranks (ring pass-KV's work split; the ranks run one after another
here, so each is timed alone as it would run on its own GPU):
- `sdpa`: `F.scaled_dot_product_attention(causal, GQA)` over the whole sequence, on one device;
- `kernels_whole`: `kernels.attend` over the whole sequence (one fused call: its overhead over SDPA);
- `rank`: one rank's compute, its 2 query chunks against every rank's key block (N `kernels.attend`
  calls, N - 1 running merges), the slowest rank; `sdpa / rank` is the attention speed-up N ranks
  can reach before any communication (ideal: N);
- `merge`: one `merge_pair` of two (B, H, T/N, D) partials, and the share of a rank's time all its
  merges take.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...attention import kernels
from ...attention.merge import Accumulator, merge_pair
from ..calibrate import median_seconds


def _head_tail(t: int, n: int) -> list[torch.Tensor]:
    chunks = torch.arange(t).tensor_split(2 * n)
    return [torch.cat([chunks[r], chunks[2 * n - 1 - r]]) for r in range(n)]


def time_length(t: int, world: int, heads: int, kv_heads: int, head_dim: int, dtype, device, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(t)
    q = torch.randn(1, heads, t, head_dim, generator=gen).to(device, dtype)
    k, v = (torch.randn(1, kv_heads, t, head_dim, generator=gen).to(device, dtype) for _ in range(2))
    scale = 1 / math.sqrt(head_dim)
    cols = torch.arange(t)
    sdpa = median_seconds(
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True), repeats, device
    )
    whole = median_seconds(lambda: kernels.attend(q, k, v, cols, cols, scale=scale), repeats, device)
    shards = _head_tail(t, world)
    blocks = [(k.index_select(2, c.to(device)), v.index_select(2, c.to(device))) for c in shards]

    def rank_compute(r):
        qr = q.index_select(2, shards[r].to(device))
        acc = Accumulator()
        for s, (kb, vb) in enumerate(blocks):
            res = kernels.attend(qr, kb, vb, shards[r], shards[s], scale=scale)
            if res is not None:
                acc.add(*res)
        return acc

    rank = max(median_seconds(lambda r=r: rank_compute(r), repeats, device) for r in range(world))
    part = rank_compute(0)
    merge = median_seconds(lambda: merge_pair(part.out, part.lse, part.out, part.lse), repeats, device)
    return dict(
        length=t,
        world=world,
        sdpa_s=sdpa,
        kernels_whole_s=whole,
        rank_s=rank,
        speedup=sdpa / rank,
        merge_s=merge,
        merge_share=(world - 1) * merge / rank,
    )


def run_timing(device, lengths: list[int], world: int, heads: int, kv_heads: int, head_dim: int, dtype, log=print):
    """One row per length (see the module docstring); logged as a table."""
    repeats = 3
    log(
        f"  timing: {heads} query / {kv_heads} KV heads, head dim {head_dim}, {str(dtype).split('.')[-1]}, "
        f"N={world} head-tail ranks, median of {repeats}"
    )
    log(f"  {'T':>8} {'SDPA ms':>10} {'kernels ms':>11} {'rank ms':>9} {'SDPA/rank':>10} {'merge ms':>9} {'merges':>7}")
    rows = []
    for t in lengths:
        row = time_length(t, world, heads, kv_heads, head_dim, dtype, device, repeats)
        rows.append(row)
        log(
            f"  {t:>8} {row['sdpa_s'] * 1e3:>10.2f} {row['kernels_whole_s'] * 1e3:>11.2f} {row['rank_s'] * 1e3:>9.2f} "
            f"{row['speedup']:>9.2f}x {row['merge_s'] * 1e3:>9.3f} {row['merge_share'] * 100:>6.1f}%"
        )
    return rows
