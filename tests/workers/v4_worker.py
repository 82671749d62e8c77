"""One rank of DeepSeek-V4's check (tests/*/test_deepseek_v4.py): dev/v4_chain_check.py's tiny model (HCA, CSA and a
sliding layer; drawn position biases and sinks) patched against the unpatched one on this process, fp64 with the
model's fp32 internals in fp64: a prompt with a left-padded row, a second turn over the cache (chained), a turn too
short to split and a fresh prompt that short (every rank runs them), the compressed entries each rank keeps (every
N-th), greedy tokens; the entries attended a few query rows at a time. Writes OUT/rank{r}.json. argv: OUT."""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)  # the repository root (dev/)
from cp_worker import gathered_equal  # noqa: E402
from hf_contextpar.eval.oracle import Fp64Internals  # noqa: E402
from records import record_each  # noqa: E402
from shared_reference import OnRankZero  # noqa: E402

import hf_contextpar  # noqa: E402
from dev import v4_chain_check as sim  # noqa: E402
from hf_contextpar.attention import entries  # noqa: E402
from hf_contextpar.cache.sharded import returned_cache  # noqa: E402


def diff(a, b, rows=None) -> float:
    d = (a - b).abs().amax(-1)
    return float((d[rows] if rows is not None else d).max())


@torch.no_grad()
def check(_, rec):
    n, rank = dist.get_world_size(), dist.get_rank()
    ids, mask, _ = sim.prompt()
    g = torch.Generator().manual_seed(n)
    more = torch.randint(3, 250, (2, 2 * n + 3), generator=g)
    last = torch.randint(3, 250, (2, 2 * n - 1), generator=g)  # < 2 tokens per rank: every rank runs it
    entries.SCORES_BYTES = 4096  # a few query rows a block: the blocked path across ranks (the reference never runs it)
    ref, cp = OnRankZero(sim.tiny_v4()), sim.tiny_v4()
    hf_contextpar.apply_context_parallel(cp, timeout=120)
    with Fp64Internals():
        outs = []
        for model in (ref, cp):
            first = model(ids, attention_mask=mask)
            m2 = torch.cat([mask, torch.ones_like(more)], 1)
            second = model(more, attention_mask=m2, cache=returned_cache(first))
            m3 = torch.cat([m2, torch.ones_like(last)], 1)
            third = model(last, attention_mask=m3, cache=returned_cache(second))
            outs.append((first.logits, second.logits, third.logits, returned_cache(third)))
        (a1, a2, a3, _), (b1, b2, b3, cache) = outs
        rec("prefill", max_diff=diff(a1, b1, mask.bool()))
        rec("second_turn", max_diff=diff(a2, b2))
        rec("short_turn", max_diff=diff(a3, b3))
        total = ids.shape[1] + more.shape[1] + last.shape[1]
        for layer in cache.layers:  # the entries each rank keeps: every N-th of the layer's
            for name, kept in getattr(layer, "kept", {}).items():
                made = total // layer.compress_rate
                rec("entries", kept=kept.shape[1], share=len(range(rank, made, n)), made=made, compressor=name)
        kw = dict(attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        a, b = ref.generate(ids, **kw), cp.generate(ids, **kw)
        rec("greedy", tokens_equal=torch.equal(a, b), ranks_agree=gathered_equal(b))
        # a fresh prompt under 2 tokens per rank (every rank runs it, no entry yet), then decode from it
        kw = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True)
        a, b = ref.generate(ids[:1, -(2 * n - 1) :], **kw), cp.generate(ids[:1, -(2 * n - 1) :], **kw)
        rec("short_prompt", max_diff=max(diff(x, y) for x, y in zip(a.logits, b.logits)))


def main():
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    record_each(sys.argv[1], ["deepseek_v4"], "family", check)


if __name__ == "__main__":
    main()
