"""One rank of the multi-turn matrix (persistent-KV partial prefill): conversations of several
turns through the sharded cache with ring pass-KV, ring pass-Q and the planner, against the
unpatched single-process model. Writes OUT/rank{r}.json."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from hf_contextpar.eval import logits_diff
from records import write_records
from shared_reference import OnRankZero

import hf_contextpar
from hf_contextpar.models import tiny_model

FAMILIES = ["llama", "mistral", "qwen3", "gemma3_text", "llama4_text", "deepseek_v3"]
STRATEGIES = ["ring_pass_kv", "ring_pass_q", "auto"]
TURNS = (40, 7, 1, 60, 3)  # 1 token, fewer than N, and more tokens than are cached


def balanced(cache) -> bool:
    counts = cache.layout.counts()
    return max(counts) - min(counts) <= 1


@torch.no_grad()
def conversation(ref, cp, n, seed):
    g = torch.Generator().manual_seed(seed)
    turns = [torch.randint(0, 256, (2, t), generator=g) for t in TURNS]
    mask = torch.ones(2, 0, dtype=torch.long)
    worst, level = 0.0, True
    rc = cc = None
    for i, t in enumerate(turns):
        new_mask = torch.ones_like(t)
        if i == 0:  # the first turn is a left-padded batch: row 1 is 13 tokens shorter
            new_mask[1, :13] = 0
        mask = torch.cat([mask, new_mask], dim=1)
        a = ref(t, attention_mask=mask, past_key_values=rc, use_cache=True)
        b = cp(t, attention_mask=mask, past_key_values=cc, use_cache=True)
        rc, cc = a.past_key_values, b.past_key_values
        worst = max(worst, logits_diff(b.logits, a.logits, mask))
        level &= balanced(cc)
    nxt = torch.cat([torch.cat(turns, 1), torch.randint(0, 256, (2, 9), generator=g)], 1)
    mask = torch.cat([mask, torch.ones(2, 9, dtype=torch.long)], 1)
    ga = ref.generate(
        nxt, attention_mask=mask, past_key_values=rc, max_new_tokens=24, min_new_tokens=24, do_sample=False
    )
    gb = cp.generate(
        nxt, attention_mask=mask, past_key_values=cc, max_new_tokens=24, min_new_tokens=24, do_sample=False
    )
    return worst, torch.equal(ga, gb), level and balanced(cc)


def main():
    out_dir = sys.argv[1]
    torch.set_num_threads(1)
    records = []
    for family in FAMILIES:
        for dtype in (torch.float64, torch.float32):
            for strategy in STRATEGIES:
                try:
                    ref = OnRankZero(tiny_model(family, dtype=dtype))
                    cp = hf_contextpar.apply_context_parallel(tiny_model(family, dtype=dtype), strategy=strategy)
                    n = dist.get_world_size()
                    worst, same, level = conversation(ref, cp, n, seed=len(records))
                    records.append(
                        dict(
                            family=family,
                            dtype=str(dtype).split(".")[-1],
                            strategy=strategy,
                            n=n,
                            max_diff=worst,
                            tokens_equal=same,
                            balanced=level,
                        )
                    )
                except Exception as e:
                    import traceback

                    records.append(dict(family=family, strategy=strategy, error=f"{e}\n{traceback.format_exc()}"))
    write_records(out_dir, records)


if __name__ == "__main__":
    main()
