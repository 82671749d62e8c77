"""The attention kernel never materialises anything O(Tq * Tk): irregular blocks (sliding window,
padding, soft-capping) are done in row tiles against only the keys each tile can see, and stay exact.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from hf_contextpar.attention import kernels
from hf_contextpar.attention.kernels import _math, attend
from hf_contextpar.plan.sharding import head_tail_plan


def _reference(q, k, v, qc, kc, valid, window, scale, softcap):
    """Plain whole-block math in fp64: every score, every mask entry at once."""
    vis = kc[None, :] <= qc[:, None]
    if window:
        vis &= (qc[:, None] - kc[None, :]) < window
    vis = vis[None, None]
    if valid is not None:
        vis = vis & valid[:, None, None, :]
    return _math(q.double(), k.double(), v.double(), vis, scale, softcap)


T = 203
_ht = head_tail_plan(T, 2)
_p = 61  # cached tokens before a second turn
_ht2 = [c + _p for c in head_tail_plan(T - _p, 2)]
COLS = {  # (query columns, key columns)
    "whole": (torch.arange(T), torch.arange(T)),  # Ulysses: the whole sequence at once
    "ht_own": (_ht[0], _ht[0]),  # ring pass-KV, a rank's own block
    "ht_other": (_ht[0], _ht[1]),  # ... and the other rank's
    "ht_all": (_ht[1], torch.arange(T)),  # all-gather KV
    "turn2": (_ht2[0], torch.cat([torch.arange(0, _p, 2), _ht2[0]])),  # cached keys with gaps, then new ones
    "decode": (torch.tensor([T - 1]), torch.arange(0, T, 3)),
}


@pytest.mark.parametrize("cols", sorted(COLS))
@pytest.mark.parametrize(
    "window,padded,softcap,kv_heads",
    [
        (w, p, s, h)
        for w, p, s, h in itertools.product([None, 1, 7, 40, 500], [False, True], [None, 5.0], [4, 2, 1])
        if h == 2 or (p and s is None)  # GQA variants on the padded case, to keep the matrix small
    ],
)
def test_tiled_attend_is_exact(monkeypatch, cols, window, padded, softcap, kv_heads):
    """Tiles of a few rows against whole-block math, in fp64 (tests/unit/test_units.py: one tile per block)."""
    monkeypatch.setattr(kernels, "_TILE_ELEMS", 300)
    qc, kc = COLS[cols]
    g = torch.Generator().manual_seed(len(qc) + len(kc) + (window or 0))
    b, h, d = 2, 4, 8
    q = torch.randn(b, h, len(qc), d, generator=g, dtype=torch.float64)
    k = torch.randn(b, kv_heads, len(kc), d, generator=g, dtype=torch.float64)
    v = torch.randn(b, kv_heads, len(kc), d, generator=g, dtype=torch.float64)
    valid = torch.rand(b, len(kc), generator=g) > 0.3 if padded else None
    got = attend(q, k, v, qc, kc, scale=0.3, key_valid=valid, window=window, softcap=softcap)
    out, lse = _reference(q, k, v, qc, kc, valid, window, 0.3, softcap)
    seen = ~torch.isneginf(lse)
    if got is None:
        assert not seen.any()
        return
    assert torch.equal(torch.isneginf(got[1]), ~seen)
    assert (got[0][~seen] == 0).all()
    assert ((got[0] - out)[seen].abs() < 1e-12).all()
    assert ((got[1] - lse)[seen].abs() < 1e-12).all()


def _largest_allocation(fn) -> int:
    """Bytes of the largest single CPU allocation any op makes while fn runs (torch's memory profiler)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(e.self_cpu_memory_usage for e in prof.events())


@pytest.mark.parametrize("window,padded,softcap", [(64, True, None), (None, True, None), (64, False, 20.0)])
def test_long_windowed_sequence_has_no_quadratic_temporary(monkeypatch, window, padded, softcap):
    """Ulysses' whole-sequence block at T=2048 with 256 KiB tiles: a (T, T) bool alone would be 4 MiB (and
    the old int64 window temporary 32 MiB). Every allocation must fit in one tile, or be the O(T) output."""
    monkeypatch.setattr(kernels, "_TILE_ELEMS", 1 << 16)
    t, b, h, hk, d = 2048, 1, 2, 1, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, t, d, generator=g) for n in (h, hk, hk))
    cols = torch.arange(t)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[:, :100] = False  # left padding
    biggest = _largest_allocation(
        lambda: attend(
            q, k, v, cols, cols, scale=0.25, key_valid=valid if padded else None, window=window, softcap=softcap
        )
    )
    tile_bytes = kernels._TILE_ELEMS * 4  # one fp32 mask or score tile
    output_bytes = b * h * t * (d + 1) * 4  # out and lse
    assert biggest <= max(tile_bytes, output_bytes), f"{biggest / 2**20:.1f} MiB allocated at once"
    assert biggest * 8 < t * t  # far below any (T, T) bool


def test_tiles_are_bounded_and_windowed_tiles_mostly_fused(monkeypatch):
    """Count the masks built and the fused calls made for a windowed whole-sequence block: each mask is at
    most one tile, and most of the attention runs in the fused kernel without a mask."""
    t, window = 4096, 512
    masks, unmasked = [], []
    real_masked, real_fused = kernels._masked, kernels._fused

    def masked(q, k, v, vis, scale, softcap):
        masks.append(vis.shape[-2] * vis.shape[-1])
        return real_masked(q, k, v, vis, scale, softcap)

    def fused(q, k, v, bias, is_causal, scale):
        if bias is None:
            unmasked.append(q.shape[2] * k.shape[2] // (2 if is_causal else 1))
        return real_fused(q, k, v, bias, is_causal, scale)

    monkeypatch.setattr(kernels, "_masked", masked)
    monkeypatch.setattr(kernels, "_fused", fused)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, t, 16, generator=g) for _ in range(3))
    cols = torch.arange(t)
    attend(q, k, v, cols, cols, scale=0.25, window=window)
    assert masks and max(masks) <= kernels._TILE_ELEMS
    assert sum(unmasked) > 2 * sum(masks)  # the fused kernel does most of the work
    assert sum(masks) + sum(unmasked) < 2 * t * window  # only the band around the window is attended
