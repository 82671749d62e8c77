"""Tensor parallelism inside x context parallelism across (hf_contextpar.mesh, issue 29): TP 2 x CP 2
on 4 gloo processes against the unpatched model on one process, DCP (more TP ranks than KV heads:
TP 4 x CP 1 on 2 KV heads, TP 2 x CP 2 on 1), and the refusals.

This file holds the checks that run in the pytest process; the others, and the feature's whole description, are in
tests/multi_process/test_tp.py.
"""

from __future__ import annotations

import pytest
import torch

from hf_contextpar.attention.ulysses import check_ulysses
from hf_contextpar.cache.sharded import ShardLayout
from hf_contextpar.errors import HeadsNotDivisibleError
from hf_contextpar.mesh import check_tp_heads
from hf_contextpar.models import tiny_config


def test_tp_head_checks():
    """Load-time refusal where tp does not divide the heads; Ulysses reads the heads a rank holds."""
    config = tiny_config("llama")  # 4 query / 2 KV heads
    assert check_tp_heads(config, 2) == 1
    assert check_tp_heads(config, 4) == 2  # DCP: two TP ranks per KV head
    for tp in (3, 8):  # a query head split; more TP ranks than query heads
        with pytest.raises(HeadsNotDivisibleError):
            check_tp_heads(config, tp)
    check_ulysses(config, 2)
    check_ulysses(config, 2, held=(4, 2))
    with pytest.raises(HeadsNotDivisibleError):
        check_ulysses(config, 2, held=(2, 1))
    with pytest.raises(HeadsNotDivisibleError):
        check_ulysses(config, 2, held=(0, 0))


def test_dcp_slot_split():
    """The DCP split of a CP rank's slots: rank j of dcp holds the slots s with s % dcp == j, and `held`
    counts them below any slot (an int or a tensor of slots), so buffer indices and trims agree with it."""
    layout = ShardLayout(0, 1)
    for size in range(1, 5):
        for index in range(size):
            layout.set_dcp(index, size)
            slots = torch.arange(40)
            assert torch.equal(layout.mine(slots), slots % size == index)
            below = [sum(1 for s in range(x) if s % size == index) for x in range(40)]
            assert [layout.held(x) for x in range(40)] == below
            assert layout.held(slots).tolist() == below
