"""DeepSeek-V4 (docs/design.md, "Compressed attention"): refused at apply with what blocks, and the design that would
make it exact checked on one process (dev/v4_chain_check.py): contiguous spans continuing from the compressors'
unfinished groups the span before left, every span's compressors handed the whole layer's entries, are the one
forward to fp64 rounding once the model's fp32 internals run in fp64; a 1-token span is not (HCA's decode path).
"""

from __future__ import annotations

import pytest
import torch
from hf_contextpar.eval.oracle import Fp64Internals

from dev import v4_chain_check as sim
from dev.census.configs import build
from hf_contextpar.errors import UnsupportedModelError
from hf_contextpar.model.contract import check_model


def test_refused_at_apply_naming_what_blocks():
    model = build("deepseek_v4", torch.float64, "eager")
    with pytest.raises(UnsupportedModelError) as err:
        check_model(model)
    text = str(err.value)
    for what in ("buffer_kv", "overlap_kv", "entry_count", "block_bias", "K=V", "top-k over the whole row"):
        assert what in text, what
    assert "compressed attention (CSA, HCA)" in text and "recurrent layers carry" not in text


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
