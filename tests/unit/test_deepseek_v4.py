"""DeepSeek-V4 (docs/design.md, "Compressed attention"): exact under context parallelism at N = 2, 3
(tests/workers/v4_worker.py), what moves queries refused, and the design checked on one process (dev/v4_chain_check.py):
contiguous spans continuing from the compressors' unfinished groups the span before left, every span's compressors handed the whole layer's entries, are the one
forward to fp64 rounding once the model's fp32 internals run in fp64; a 1-token span is not (HCA's decode path).

This file holds the checks that run in the pytest process; the ones that launch ranks are in tests/multi_process/test_deepseek_v4.py.
"""

from __future__ import annotations

import pytest
import torch
from hf_contextpar.eval.oracle import Fp64Internals

from dev import v4_chain_check as sim
from hf_contextpar.attention.entries import attend_entries
from hf_contextpar.attention.entries import check as check_entries
from hf_contextpar.errors import UnsupportedModelError
from hf_contextpar.settings import Settings


@pytest.mark.parametrize("strategy", ["ring_pass_q", "ulysses"])
def test_strategies_moving_queries_refused(strategy):
    """The entries' bias and the indexer's top-k are made on the query's rank: what moves queries is refused."""
    with pytest.raises(UnsupportedModelError, match="compressed attention"):
        check_entries(Settings(strategy=strategy), "deepseek_v4")


@pytest.fixture(scope="module")
def model():
    return sim.tiny_v4()


@pytest.mark.parametrize("what,padded", [("N=3", False), ("N=4, cuts inside CSA and HCA groups", True)])
def test_the_design_is_the_one_forward(model, what, padded):
    with Fp64Internals():
        d = sim.check(model, sim.PARTITIONS[what], padded, plain=False)
    assert d["gathered"] < 1e-12 and d["entries"] < 1e-12 and d["decode"] < 1e-12, d


def test_a_one_token_span_is_not(model):
    """Why each chained rank needs at least 2 tokens: HCA gives a 1-token forward no block_bias."""
    with Fp64Internals():
        d = sim.check(model, sim.PARTITIONS["N=4, a 1-token span (expected to differ)"], False, plain=False)
    assert d["gathered"] > 1e-3, d


def test_entries_attended_in_blocks_of_query_rows():
    """The entries' attention in blocks of query rows (a budget of 3 rows' scores) is the one softmax over them: a
    bias with -inf picks, a row that sees no entry (out 0, LSE -inf), fp64."""
    g = torch.Generator().manual_seed(0)
    q, keys = torch.randn(2, 4, 10, 8, generator=g, dtype=torch.float64), torch.randn(2, 1, 6, 8, generator=g).double()
    bias = torch.where(torch.rand(2, 1, 10, 6, generator=g) < 0.4, float("-inf"), 0.0).double()
    bias[0, :, 3] = float("-inf")
    scores = q @ keys.transpose(-1, -2) * 0.3 + bias
    want_lse = torch.logsumexp(scores, -1)
    want = (torch.softmax(scores, -1).nan_to_num(0.0)) @ keys
    one_row = 2 * 4 * 6 * 8  # bytes of one query row's scores
    for budget in (3 * one_row, 1 << 30):
        out, lse = attend_entries(q, keys, bias, 0.3, budget=budget)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse)) and bool((out[0, :, 3] == 0).all())
        finite = torch.isfinite(want_lse)
        assert (lse[finite] - want_lse[finite]).abs().max() < 1e-12 and (out - want).abs().max() < 1e-12
        row = bias[:, :, 5:6]  # one bias row for every query
        out, lse = attend_entries(q, keys, row, 0.3, budget=budget)
        assert (out - torch.softmax(q @ keys.transpose(-1, -2) * 0.3 + row, -1) @ keys).abs().max() < 1e-12
    out, lse = attend_entries(q[:, :, :0], keys, bias[:, :, :0], 0.3)  # no query row
    assert out.shape == (2, 4, 0, 8) and lse.shape == (2, 4, 0)
