"""Score biases from global columns (hf_contextpar/attention/bias.py): ALiBi (BLOOM, MPT, Falcon's alibi=True) and
Doge's per-key bias from the keys' values.

The kernels' bias on its own (one process): attending key blocks apart and merging their partials by LSE is the
whole attention under the explicit bias, with padding, a window, batched decode's per-sequence columns, Ulysses' head
slice. Then the families against the unpatched model on one process at 2,048 tokens, where the bias dominates
(tests/workers/bias_worker.py: each prefill strategy, KV-Runahead, pass-Q and all-gather included, a left-padded batch,
both decode modes, a second turn), fp64 with the models' fp32 softmax kept in fp64: 1e-10; Doge with its A drawn
from N(0, 1), where its census model's zeros make the bias a constant softmax ignores.

This file holds the checks that run in the pytest process; the ones that launch ranks are in tests/multi_process/test_score_bias.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_contextpar.attention.bias import ScoreBias
from hf_contextpar.attention.kernels import attend
from hf_contextpar.attention.merge import Accumulator


class _Slopes:
    """A bias by distance and key position per head: slope_h * (k - q) + 0.01 * k (q-dependent, so a tile's rows
    and columns both matter)."""

    def __init__(self, heads):
        self.slopes = torch.linspace(0.5, 0.01, heads, dtype=torch.float64)

    def __call__(self, bias, q_cols, k_cols):
        k = k_cols.to(torch.float64)
        k = k[None] if k.dim() == 1 else k  # (B | 1, Tk)
        rel = k[:, None, None, :] - q_cols.to(torch.float64)[None, None, :, None]  # (B | 1, 1, Tq, Tk)
        return self.slopes[None, :, None, None] * rel + 0.01 * k[:, None, None, :]


def _reference(q, k, v, q_cols, k_cols, scale, bias, valid, window=None):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale + bias
    vis = k_cols[None, :] <= q_cols[:, None]
    if window is not None:
        vis &= k_cols[None, :] > q_cols[:, None] - window
    vis = vis[None, None] & valid[:, None, None, :]
    return torch.softmax(s.masked_fill(~vis, -math.inf), -1) @ v


@pytest.mark.parametrize("window", [None, 9])
def test_a_bias_over_key_blocks_merges_to_the_whole(window):
    g = torch.Generator().manual_seed(0)
    b, h, t, d = 2, 4, 40, 8
    q, k, v = (torch.randn(b, h, t, d, generator=g, dtype=torch.float64) for _ in range(3))
    cols = torch.arange(t)
    padding = torch.ones(b, t, dtype=torch.bool)
    padding[1, :6] = False
    bias = ScoreBias(_Slopes(h), t, padding)
    whole = bias.block(cols, cols, torch.float64, "cpu")
    ref = _reference(q, k, v, cols, cols, 0.3, whole, padding, window)
    acc = Accumulator(t)
    for a, z in [(0, 13), (13, 14), (14, 40)]:  # uneven blocks, one of a single key
        attend(q, k[:, :, a:z], v[:, :, a:z], cols, cols[a:z], scale=0.3, key_valid=padding[:, a:z], window=window,
               bias=bias, into=acc)  # fmt: skip
    out, _ = acc.result()
    # Ulysses: heads 2..3 alone, with their slice of the bias
    half, _ = attend(q[:, 2:], k[:, 2:], v[:, 2:], cols, cols, scale=0.3, key_valid=padding, window=window,
                     bias=bias.head_slice(2, 4))  # fmt: skip
    for row, first in [(0, 0), (1, 6)]:  # the real query rows (a padded row's see no key)
        torch.testing.assert_close(out[row, :, first:], ref[row, :, first:], rtol=0, atol=1e-12)
        torch.testing.assert_close(half[row, :, first:], ref[row, 2:, first:], rtol=0, atol=1e-12)


def test_a_bias_over_per_sequence_key_columns():
    """Batched decode's keys: (B, Tk) columns per sequence, -1 an empty slot; one query per sequence."""
    g = torch.Generator().manual_seed(1)
    b, h, d = 2, 4, 8
    q = torch.randn(b, h, 1, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, h, 5, d, generator=g, dtype=torch.float64) for _ in range(2))
    k_cols = torch.tensor([[0, 3, 7, 9, -1], [1, 2, 5, 8, 9]])
    q_cols = torch.tensor([9])
    bias = ScoreBias(_Slopes(h), 10, None)
    out, _ = attend(q, k, v, q_cols, k_cols, scale=0.5, bias=bias)
    for row in range(b):
        keep = k_cols[row] >= 0
        cols = k_cols[row][keep]
        s = (q[row] @ k[row][:, keep].transpose(-1, -2)) * 0.5 + bias.rows([row]).block(q_cols, cols, q.dtype, "cpu")[0]
        torch.testing.assert_close(out[row], torch.softmax(s, -1) @ v[row][:, keep], rtol=0, atol=1e-12)


def test_a_bias_defined_up_to_a_length_refuses_longer_forwards():
    """MPT's table and Doge's top-k window (`fn.max_length`): a longer forward is refused before any message."""
    from types import SimpleNamespace

    from hf_contextpar.attention.bias import for_forward
    from hf_contextpar.errors import UnsupportedInputError

    class Limited(_Slopes):
        max_length = 64

    fn = Limited(2)
    step = SimpleNamespace(plan=SimpleNamespace(seq_length=64, padding=None), state={})
    assert for_forward(step, fn) is for_forward(step, fn)  # one per forward and fn
    step.plan.seq_length = 65
    with pytest.raises(UnsupportedInputError, match="at most 64"):
        for_forward(SimpleNamespace(plan=step.plan, state={}), fn)
