"""The server's decisions that rank 0 makes alone and every rank applies (hf_contextpar/tools/serve): which kept
conversation a request reuses and how much of it, what is evicted, and the lockstep plan's round trip. In process:
the server's own multi-process behaviour is tests/multi_process/test_serve.py's."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, GenerationConfig

from hf_contextpar.tools.serve.conversations import Conversations, Reuse
from hf_contextpar.tools.serve.lockstep import Job, Lockstep, scored


class Kept:
    """A stand-in for a kept cache's structure (what `plan` reads): its sliding windows, its layers."""

    def __init__(self, windows=(), layers=()):
        self.windows, self.layers = windows, layers


def test_longest_common_prefix_leaves_a_token_to_prefill():
    table = Conversations(budget=10**9)
    table.keep([1, 2, 3, 4], Kept(), nbytes=40)
    table.keep([1, 2, 9], Kept(), nbytes=30)
    assert table.plan([1, 2, 3, 4, 5, 6], 4) == (Reuse(0, 4, crop=0), [])  # extends conversation 0: all of it
    assert table.plan([1, 2, 3, 4], 4) == (Reuse(0, 3, crop=-1), [])  # the same tokens: the last one prefilled
    assert table.plan([1, 2, 9, 9], 4) == (Reuse(1, 3, crop=0), [])
    assert table.plan([7, 8], 4) == (None, [])


def test_a_cache_with_sliding_or_recurrent_layers_is_reused_only_whole():
    table = Conversations(budget=10**9)
    table.keep([1, 2, 3, 4], Kept(windows=(3, None)), nbytes=40)
    assert table.plan([1, 2, 3, 4, 5], 4)[0] == Reuse(0, 4, crop=0)
    assert table.plan([1, 2, 3, 7, 5], 4)[0] is None  # going back would need the keys its window dropped


def test_the_footprint_decides_what_fits_before_anything_is_kept():
    table = Conversations(budget=1000)
    assert table.fits(10**6) and table.room() is None  # nothing measured: nothing refused
    table.footprint.fixed, table.footprint.per_token = 200.0, 10.0  # what `Lockstep.measure` found
    assert table.room() == 80 and table.fits(80) and not table.fits(81)
    table.keep([1] * 10, Kept(), nbytes=400)  # a kept cache holding more per token raises the estimate
    assert table.footprint.per_token == 20.0 and table.room() == 40


def test_least_recently_used_goes_first_to_keep_the_budget():
    table = Conversations(budget=100)
    table.keep([1] * 4, Kept(), nbytes=40)  # 10 bytes a token
    table.keep([2] * 4, Kept(), nbytes=40)
    reuse, evict = table.plan([3] * 2, 0)  # 20 more: 100 holds it
    assert (reuse, evict) == (None, [])
    reuse, evict = table.plan([3] * 3, 2)  # 50 more: the oldest goes
    assert evict == [0]
    reuse, evict = table.plan([1] * 4 + [5] * 2, 2)  # reusing the oldest: the other goes, never the reused one
    assert reuse.key == 0 and evict == [1]
    table.evict(evict)
    assert list(table.entries) == [0] and table.take(reuse) is not None and not table.entries


def test_take_crops_the_kept_cache_to_the_reused_prefix():
    cache = DynamicCache()
    cache.update(torch.zeros(1, 1, 5, 2), torch.zeros(1, 1, 5, 2), 0)
    table = Conversations(budget=10**9)
    table.keep([1, 2, 3, 4, 5], cache, nbytes=1)
    reuse, _ = table.plan([1, 2, 3, 9], 1)
    assert reuse == Reuse(0, 3, crop=-2)
    assert table.take(reuse).get_seq_length() == 3


def test_the_plan_carries_the_config_and_a_seed_every_rank_uses():
    """One process (no group): the plan's generation config round-trips, a request without a seed gets one drawn
    (every rank then seeds with it), and a scoring request reuses nothing."""
    lock = Lockstep.__new__(Lockstep)
    lock.conversations = Conversations(budget=10**9)
    lock.conversations.keep([1, 2, 3], Kept(), nbytes=3)
    config = GenerationConfig(max_new_tokens=5, do_sample=True, temperature=0.7, top_p=0.9)
    call = lock._plan(Job([1, 2, 3, 4], config, seed=None))
    assert GenerationConfig.from_dict(call.generation).to_diff_dict() == config.to_diff_dict()
    assert isinstance(call.seed, int) and call.reuse == Reuse(0, 3, crop=0)
    assert lock._plan(Job([1, 2, 3, 4], config, seed=7)).seed == 7
    assert lock._plan(Job([1, 2, 3, 4], config, seed=7, scores=1)).reuse is None


def test_scored_log_probabilities_line_up_with_their_tokens():
    """Token i's log-probability is read from the row before it: the prompt's rows from its forward, the new
    tokens' from generate's logits; the first prompt token has none."""
    vocab = 6
    prompt_logits = torch.randn(1, 2, vocab)  # a 3-token prompt: rows predicting tokens 1 and 2
    step = torch.randn(1, vocab)

    class Out:
        sequences = torch.tensor([[0, 4, 2, 5]])
        logits = (step,)

    got = scored([0, 4, 2], prompt_logits, Out, top=2)
    lsm = [prompt_logits[0, 0].log_softmax(-1), prompt_logits[0, 1].log_softmax(-1), step[0].log_softmax(-1)]
    assert got["tokens"] == [0, 4, 2, 5] and got["token_logprobs"][0] is None
    assert got["token_logprobs"][1:] == pytest.approx([float(lsm[0][4]), float(lsm[1][2]), float(lsm[2][5])])
    assert [len(t) for t in got["top"][1:]] == [2, 2, 2]
    assert got["top"][3][0] == (int(lsm[2].argmax()), pytest.approx(float(lsm[2].max())))
