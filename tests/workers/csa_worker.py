"""One rank of the CSA checks (issue 41): the approximate mode against its own one-process reference
(`sparse.reference.csa_reference`, the same definition as a mask) and, with every level keeping every
token, against the unpatched model. fp64, a left-padded batch of a length N does not divide, a second
turn over the cache, greedy generate; the attention bytes the pruning saves. Writes OUT/rank{r}.json."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from hf_contextpar.eval.csa_reference import csa_reference
from hf_contextpar.eval.oracle import Fp64Internals
from hybrids import hybrid_config
from records import run_cases
from shared_reference import OnRankZero
from transformers import AutoModelForCausalLM

import hf_contextpar
from hf_contextpar.models import tiny_model
from hf_contextpar.sparse import CSA

FAMILIES = ("llama", "qwen2_sliding", "qwen3_next")
TOPOLOGIES = {2: "2x1", 3: "3x1", 4: "2x2"}  # every N: two levels above 1 where N allows (2x2: node, world)


def build(family: str, seed: int = 0):
    if family == "qwen3_next":  # attention at layers 1, 3, 5 between Gated DeltaNet ones: layer 3 prunes
        config = hybrid_config(family)
        config.num_hidden_layers, config.layer_types = 6, ["linear_attention", "full_attention"] * 3
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(
            config, dtype=torch.float64, experts_implementation="eager", attn_implementation="sdpa"
        ).eval()
    if family == "qwen2_sliding":  # needle-lm's shape: a sliding layer (exact under CSA) before the full ones
        types = ["sliding_attention"] + ["full_attention"] * 3
        return tiny_model(
            "qwen2",
            torch.float64,
            seed,
            num_hidden_layers=4,
            layer_types=types,
            sliding_window=3,
            use_sliding_window=True,
        )
    return tiny_model(family, dtype=torch.float64, seed=seed, num_hidden_layers=4)


def conversation(family: str, csa: CSA, n: int, against_plain: bool, partitions=None) -> dict:
    """The CP model beside the reference (or, keeping everything, the unpatched model) over two turns and a
    generate; the worst logit gap on real tokens, whether the tokens match, the prefill's attention bytes."""
    g = torch.Generator().manual_seed(len(family) + n)
    ids = torch.randint(0, 256, (2, 13 * n + 4), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    turn = torch.randint(0, 256, (2, 5), generator=g)
    model, cp = (
        build(family),
        hf_contextpar.apply_context_parallel(build(family), sparse=csa, partitions=partitions),
    )
    ref = OnRankZero(model)
    runtime = hf_contextpar.get_runtime(cp)
    # placement decides levels: the reference cuts what the run will
    reference = csa_reference(model, csa, n, runtime.partitions) if not against_plain else contextlib.nullcontext()
    with torch.no_grad(), Fp64Internals(), reference:  # a hybrid's fp32 scans in fp64 too
        a = ref(ids, attention_mask=mask, use_cache=True)
        b = cp(ids, attention_mask=mask, use_cache=True)
        sent = runtime.last_forward["bytes_sent"]
        ran = runtime.last_forward["approximate"]
        cut = [[len(r) for r in runtime.last_plan.shards.token_rows]]
        formula = expected_sent(cp, runtime, mask, cut[0]) if family == "llama" else sent  # every layer full
        both = torch.cat([mask, torch.ones_like(turn)], 1)
        a2 = ref(turn, attention_mask=both, past_key_values=a.past_key_values, use_cache=True)
        b2 = cp(turn, attention_mask=both, past_key_values=b.past_key_values, use_cache=True)
        short = ids[:, : max(1, n - 1)]  # fewer tokens than ranks: every rank runs them whole, exact
        a3, b3 = ref(short).logits, cp(short).logits
        plain = OnRankZero(build(family))(ids, attention_mask=mask).logits
        moved = (plain - b.logits)[mask.bool()].abs().max().item()
        ga = ref.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        gb = cp.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        cut.append(runtime.partitions(ids.shape[1]))  # what the next prefill of this prompt would cut
        again = cp(ids, attention_mask=mask).logits  # every layer's geometry known now: receives posted ahead
    real = mask.bool()
    gaps = [(a.logits - b.logits)[real].abs().max().item(), (a2.logits - b2.logits).abs().max().item()]
    gaps.append((a.logits - again)[real].abs().max().item())
    worst = max(*gaps, (a3 - b3).abs().max().item())
    total = torch.tensor([float(sent)])
    dist.all_reduce(total)
    hf_contextpar.remove_context_parallel(cp)
    return dict(
        max_diff=worst,
        turns=gaps,
        tokens_equal=torch.equal(ga, gb),
        bytes_sent=total.item(),
        approximate=ran,
        from_plain=moved,
        partitions=cut,
        traffic=(sent, formula),
    )


def expected_sent(cp, runtime, mask, sizes) -> float:
    """This rank's attention bytes in the prefill by CSA's traffic formula (plan/strategies.py, the one `predict`
    averages): the chain's, each block cut to the slots its next rank's level keeps (a padded batch: the most any
    sequence keeps) at the pruning layers, whole at the exact ones."""
    from hf_contextpar.plan.strategies import STRATEGIES, Rows
    from hf_contextpar.sparse.csa import kept_counts

    run, cfg = runtime.patched.sparse, cp.config
    bounds = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    real = [mask[:, a:b].bool() for a, b in zip(bounds, bounds[1:])]

    def pruned(s, d):
        return int(kept_counts(real[s], sizes[s], mask.shape[0], run.csa.fraction(run.csa.levels(s, d))).max())

    kv_row = 2 * mask.shape[0] * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 8  # fp64
    total = 0
    for layer in range(cfg.num_hidden_layers):
        kept = None if layer in run.exact else pruned
        total += STRATEGIES["csa"].traffic(Rows(runtime.rank, sizes, sizes, kv_row, 0, 0, kept=kept))[0]
    return total


def cases(n: int):
    topology = TOPOLOGIES[n]
    keep_all = CSA(keep=(1.0, 1.0), topology=topology, observe=8)
    sparse = CSA(keep=(0.6, 0.3), topology=topology, observe=8)
    front = dict(world=n, entries={"16": [2.0**-i for i in range(n)]})  # uneven whatever the timings
    out = []
    for family in FAMILIES:
        # partitions balanced by the model's work terms (the default), or front-loaded
        fixed = front if family != "qwen2_sliding" else None

        def check(family=family, fixed=fixed):
            exact = conversation(family, keep_all, n, against_plain=True, partitions=fixed)  # bytes: one placement
            cut = conversation(family, sparse, n, against_plain=False, partitions=fixed)
            ok = exact["max_diff"] < 1e-10 and exact["tokens_equal"] and cut["max_diff"] < 1e-10 and cut["tokens_equal"]
            ok = ok and cut["bytes_sent"] < exact["bytes_sent"] and cut["approximate"] == sparse.resolved(n).describe()
            ok = ok and cut["traffic"][0] == cut["traffic"][1] and exact["traffic"][0] == exact["traffic"][1]
            ok = ok and cut["from_plain"] > 1e-6  # the pruning changed the answer: the mode is not the exact one
            ok = ok and (fixed is None or all(p[0] > p[-1] for p in cut["partitions"]))  # the table's, uneven
            # the default cuts a prompt the same after prefills, decode and generate as before: no timing moves it
            ok = ok and (fixed is not None or cut["partitions"][0] == cut["partitions"][1])
            return dict(ok=ok, exact=exact, sparse=cut)

        out.append((family, check))
    return out


if __name__ == "__main__":
    import sys

    only = set(sys.argv[2].split(",")) if len(sys.argv) > 2 else None  # launch.selected's subset
    run_cases(lambda n: [(name, check) for name, check in cases(n) if only is None or name in only])
