"""DSA under context parallelism: the indexer's top-k rows themselves, compared with one process's.

Run under torchrun (N processes, gloo); prints one line per family, strategy and score kind on rank 0:
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 3 dev/dsa_selection_check.py deepseek_v32,glm_moe_dsa,axk2 \
        ring_pass_kv,allgather_kv,kv_runahead
Each rank's indexer rows (its own query columns in prefill, every row in decode) must hold the very columns the
unpatched model's indexer keeps for those queries, with random scores and with every visible score tied at 0
(the indexer's head weights zeroed: torch.topk's pick among equal values), on a left-padded batch of two 97-token
rows; fp64 logits within 1e-10 and greedy tokens identical. A family without a tiny config (axk2) is built from
patches.DSA_TINY.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from hf_contextpar.eval import logits_diff
from hf_contextpar.patches import DSA_TINY
from transformers import AutoConfig, AutoModelForCausalLM

import hf_contextpar
from hf_contextpar.models import TINY_BASE, TINY_CONFIGS, tiny_model


def build(family: str, tied: bool):
    if family in TINY_CONFIGS:
        model = tiny_model(family, dtype=torch.float64)
    else:
        torch.manual_seed(0)
        config = AutoConfig.for_model(family, **{**TINY_BASE, **DSA_TINY})
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float64, attn_implementation="sdpa").eval()
    for module in model.modules():
        if tied and type(module).__name__.endswith("Indexer"):
            module.weights_proj.weight.data.zero_()
    return model


def capture(model) -> list:
    """Every indexer call's top-k indices, in call order."""
    got = []
    for m in model.modules():
        if type(m).__name__.endswith("Indexer"):
            m.register_forward_hook(lambda mod, args, out: got.append(out.clone()))
    return got


def same_rows(a, b) -> bool:
    return torch.equal(torch.sort(a, -1).values, torch.sort(b, -1).values)


@torch.no_grad()
def check(family: str, strategy: str, tied: bool, rank: int) -> tuple:
    ref, cp = build(family, tied), build(family, tied)
    hf_contextpar.apply_context_parallel(cp, strategy=strategy, timeout=60)
    got_ref, got_cp = capture(ref), capture(cp)
    ids = torch.randint(0, 256, (2, 97), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :20] = 0
    diff = logits_diff(cp(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits, mask)
    q = hf_contextpar.get_runtime(cp).last_plan.shards.q_cols[rank]
    prefill = all(same_rows(a[:, q], b) for a, b in zip(got_ref, got_cp))
    layers = len(got_ref)
    got_ref.clear(), got_cp.clear()
    a = ref.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    b = cp.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    decode = len(got_ref) == len(got_cp) and all(same_rows(x, y) for x, y in zip(got_ref[layers:], got_cp[layers:]))
    return diff, prefill, decode, torch.equal(a, b)


def main():
    families, strategies = sys.argv[1].split(","), sys.argv[2].split(",")
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    for family in families:
        for strategy in strategies:
            for tied in (False, True):
                diff, prefill, decode, tokens = check(family, strategy, tied, rank)
                ok = torch.tensor([int(prefill and decode and tokens and diff < 1e-10)])
                dist.all_reduce(ok, op=dist.ReduceOp.MIN)
                if rank == 0:
                    print(
                        f"{family} {strategy} N={n} tied={tied} max_diff={diff:.1e} prefill_selection_equal={prefill} "
                        f"decode_selection_equal={decode} tokens_equal={tokens} every_rank_ok={bool(ok)}",
                        flush=True,
                    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
