"""Where a decode step's host time goes under context parallelism (issue #44: TTIT at short contexts).

    torchrun --nproc_per_node 2 dev/profile_decode.py --model tiny-llama_gqa8 --length 4096 --steps 200
    python dev/profile_decode.py --plan-only --length 4096 --steps 1000     # the decode plan alone, one process
    torchrun --nproc_per_node 2 dev/profile_decode.py --ops                 # aten ops per step, by library function
    torchrun --nproc_per_node 2 dev/profile_decode.py --contention          # the unpatched step alone vs on every rank
    torchrun --nproc_per_node 2 dev/profile_decode.py --ab --rounds 12      # the TTIT ratio, paired round by round
    torchrun --nproc_per_node 2 dev/profile_decode.py --floor --rounds 12   # the unpatched step in lockstep vs alone
    torchrun --nproc_per_node 2 dev/profile_decode.py --ab --floor          # both, and patched / lockstep, paired

Rank 0 times the unpatched model's decode step, then the patched model's, each after a prefill of
`--length` tokens, one thread a rank, passing the growing attention mask as generate() does; during the patched steps it times each piece of the library's
work with perf_counter: the forward pre-hook (input contract, plan, rank check, input split, cache
begin), the attention adapter per layer (its kernel, the partial's packing, the all-gather, the
merge) and the forward hook (cache end). It prints the minimum and the median over steps: on a
shared machine the minimum is the host work, the median adds the load (waits and preemption), so
compare figures from one run only. The pieces are wrapped from outside (no code of the library
changes), so the times include one Python call each.

`--contention` times instead the unpatched step alone (the other ranks asleep, in no collective) against the
same step while every rank runs it at once, in alternating rounds: what cores that share caches and memory charge
any N-process decode that runs the model's layers on every rank, before the library adds anything.

`--ab` gives the bench's TTIT ratio (patched step on every rank / unpatched step on rank 0 alone) with the
machine's drift paired out: the two alternate in short rounds, and the ratio is that of the two medians over all
rounds, with the spread of the per-round ratios beside it.

`--floor` pairs the same way the unpatched step alone against the unpatched step run on every rank in lockstep: one
shared-memory all-gather of a decode partial's size after each attention layer, as decode synchronises the ranks,
and nothing else of the library. What any exact N-process decode pays on this machine before its own host work
and before its attention over 1/N of the keys saves anything: each gather waits for the slower rank. With `--ab`
every round runs all three, and the patched step over the lockstep one is the library's own cost.

`--ops` counts instead the top-level aten ops of a decode step (torch.profiler, ops not issued by another op),
unpatched and patched, and the patched step's ops by the library function that issued them: a count the load
does not move, and on a GPU each op is a launch (host time per layer).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
import torch.distributed as dist

import hf_contextpar
from hf_contextpar import patched
from hf_contextpar import runtime as rt
from hf_contextpar.attention import decode
from hf_contextpar.cache import sharded
from hf_contextpar.comm import agreement, collectives
from hf_contextpar.model import contract
from hf_contextpar.models import tiny_model

TIMES = collections.defaultdict(list)
MASK = True  # pass the growing attention mask each step, as generate() does (--no-mask: none)
ORDER = (
    "pre-hook (all)",
    "  input contract",
    "  build_plan",
    "  rank check",
    "  input split",
    "  attention kernel",
    "  pack partial",
    "  all-gather",
    "  merge",
    "post-hook (all)",
    "  cache end",
)


def timed(name: str, f):
    """f, recording each call's seconds under `name`."""

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            TIMES[name].append(time.perf_counter() - start)

    return wrapper


def instrument():
    """Wrap the pieces of a decode step (before apply, so the hooks installed are the wrapped ones)."""
    R = rt.ContextParallelRuntime
    R._pre_forward = timed("pre-hook (all)", R._pre_forward)
    R._post_forward = timed("post-hook (all)", R._post_forward)
    patched.build_plan = timed("  build_plan", patched.build_plan)
    agreement.RankCheck.inputs = timed("  rank check", agreement.RankCheck.inputs)
    contract.InputContract.read = timed("  input contract", contract.InputContract.read)
    rt.shard_inputs = timed("  input split", rt.shard_inputs)
    sharded.ShardedCache.end = timed("  cache end", sharded.ShardedCache.end)
    decode.attend = timed("  attention kernel", decode.attend)
    decode.pack_partial = timed("  pack partial", decode.pack_partial)
    decode.merge_packed_out = timed("  merge", decode.merge_packed_out)
    collectives.Comm.all_gather = timed("  all-gather", collectives.Comm.all_gather)


@torch.no_grad()
def decode_steps(model, ids, steps: int, name: str) -> list:
    """Seconds of each of `steps` greedy decode forwards after a prefill of ids."""
    out = model(ids, use_cache=True, logits_to_keep=1)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    mask = torch.ones(1, ids.shape[1] + 1, dtype=torch.long) if MASK else None  # as generate() passes it
    TIMES.clear()
    for _ in range(steps):
        start = time.perf_counter()
        out = model(token, past_key_values=cache, use_cache=True, attention_mask=mask)
        token = out.logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, mask.new_ones(1, 1)], dim=1) if MASK else None
        TIMES[name].append(time.perf_counter() - start)
    return dict(TIMES)


def lockstep(model):
    """The unpatched model with one shared-memory all-gather (a decode partial's bytes: one query row's out and LSE
    per head) after every attention layer, the ranks kept in step as decode keeps them (`--floor`)."""
    from hf_contextpar.comm.shm import open_shm_gather

    gather = open_shm_gather(dist.group.WORLD, dist.get_rank(), dist.get_world_size(), torch.device("cpu"), 600)
    config = model.config
    partial = torch.zeros(config.num_attention_heads * (config.head_dim + 1))

    def meet(module, args, out):  # returns None: the layer's output stays its own
        gather.all_gather(partial)

    for m in model.modules():
        if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx"):
            m.register_forward_hook(meet)
    return model


def contention(model, ids, steps: int, rounds: int = 3, together: dict | None = None) -> dict:
    """Rank 0's unpatched decode steps alone (the other ranks asleep), then each of `together` (name -> model,
    default {"together": the same model}) run on every rank at once, in alternating rounds. Returns {"alone":
    seconds, name: seconds, ..., "rounds": per round, the medians in that order}."""
    together = together or {"together": model}
    times, medians = {"alone": [], **{name: [] for name in together}}, []
    store = dist.distributed_c10d._get_default_store()
    for i in range(rounds):
        dist.barrier()
        if dist.get_rank() == 0:
            a = decode_steps(model, ids, steps, "step")["step"]
            store.set(f"contention_{i}", "done")
        else:  # asleep until rank 0 is done (a collective's wait may spin)
            while not store.check([f"contention_{i}"]):
                time.sleep(0.05)
        row = [a] if dist.get_rank() == 0 else []
        for name, m in together.items():
            dist.barrier()
            t = decode_steps(m, ids, steps, "step")["step"]
            row.append(t)
            if dist.get_rank() == 0:
                times[name] += t
        if dist.get_rank() == 0:
            times["alone"] += a
            medians.append([statistics.median(t) for t in row])
    return dict(times, rounds=medians)


@torch.no_grad()
def count_ops(model, ids, steps: int = 10):
    """Top-level aten ops per decode step after a prefill of ids: (by op name, by op name and the innermost
    hf_contextpar function above it)."""
    from torch.profiler import ProfilerActivity, profile

    out = model(ids, use_cache=True, logits_to_keep=1)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    mask = torch.ones(1, ids.shape[1] + 1, dtype=torch.long) if MASK else None
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        for _ in range(steps):
            out = model(token, past_key_values=cache, use_cache=True, attention_mask=mask)
            token = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, mask.new_ones(1, 1)], dim=1) if MASK else None
    ops, where = collections.Counter(), collections.Counter()
    for e in prof.events():
        parent = e.cpu_parent
        if not e.name.startswith("aten::") or (parent is not None and parent.name.startswith("aten::")):
            continue
        ops[e.name] += 1 / steps
        while parent is not None and "hf_contextpar/" not in parent.name and "transformers/" not in parent.name:
            parent = parent.cpu_parent  # the innermost Python frame of the library or of the model
        if parent is not None and "hf_contextpar/" in parent.name:
            where[e.name, parent.name.split("hf_contextpar/")[-1]] += 1 / steps
    return ops, where


def show_ops(one, two):
    (ops1, _), (ops2, where) = one, two
    print(f"top-level aten ops per decode step: unpatched {sum(ops1.values()):.1f}, patched {sum(ops2.values()):.1f}")
    for name in sorted(set(ops1) | set(ops2), key=lambda k: ops1[k] - ops2[k]):
        if round(ops1[name], 1) != round(ops2[name], 1):
            print(f"  {name:48s} {ops1[name]:6.1f} {ops2[name]:6.1f}")
    print("patched, by the library function issuing them:")
    for (name, fn), n in sorted(where.items(), key=lambda x: x[0][1]):
        print(f"  {n:5.1f} {name:40s} {fn}")


def plan_only(length: int, steps: int, world: int = 2):
    """`build_plan` of replicated decode steps after a prefill of `length` tokens, in one process (no model,
    no collective): the pure part of the pre-hook, timed without the load a second rank adds."""
    from hf_contextpar.plan.forward import build_plan
    from hf_contextpar.plan.layout import ShardLayout
    from hf_contextpar.plan.policy import Policy

    layout, policy, times = ShardLayout(0, world), Policy(world), []

    def plan(n):
        past = layout.seq_length
        pos = torch.arange(past, past + n).expand(1, -1)
        return build_plan(policy, layout, batch=1, num_new=n, position_ids=pos, padding=None, logits_to_keep=1)

    layout.commit(plan(length).storage)
    for _ in range(steps):
        start = time.perf_counter()
        p = plan(1)
        times.append(time.perf_counter() - start)
        layout.commit(p.storage)
    times.sort()
    print(
        f"build_plan, decode after {length} tokens, N = {world}: min {times[0] * 1e6:.1f} us, "
        f"median {times[len(times) // 2] * 1e6:.1f} us ({steps} steps)"
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-llama_gqa8", help="a built-in tiny-<family> model")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--strategy", default="ring_pass_kv")
    p.add_argument("--plan-only", action="store_true", help="time the decode plan alone, in one process")
    p.add_argument("--no-mask", action="store_true", help="decode without the attention mask generate() passes")
    p.add_argument("--ops", action="store_true", help="count aten ops per decode step instead of timing it")
    p.add_argument("--contention", action="store_true", help="the unpatched step alone vs on every rank at once")
    p.add_argument("--ab", action="store_true", help="the patched step vs the unpatched one alone, in paired rounds")
    p.add_argument("--floor", action="store_true", help="the unpatched step alone vs in lockstep on every rank")
    p.add_argument("--rounds", type=int, default=3, help="--contention, --ab, --floor: alternating rounds of --steps")
    args = p.parse_args()
    global MASK
    MASK = not args.no_mask
    torch.set_num_threads(1)
    if args.plan_only:
        return plan_only(args.length, args.steps)
    if not (args.ops or args.contention or args.ab or args.floor):
        instrument()
    family = args.model.removeprefix("tiny-")
    ref = tiny_model(family)
    cp = hf_contextpar.apply_context_parallel(tiny_model(family), strategy=args.strategy, timeout=600)
    ids = torch.randint(0, ref.config.vocab_size, (1, args.length), generator=torch.Generator().manual_seed(0))
    dist.barrier()
    if args.contention or args.ab or args.floor:
        runs = {"unpatched step in lockstep": lockstep(tiny_model(family))} if args.floor else {}
        runs.update({"patched step on every rank": cp} if args.ab else {})
        times = contention(ref, ids, args.steps, args.rounds, runs or {"unpatched step on every rank": ref})
        if dist.get_rank() == 0:
            print(f"{args.model}, {args.length} tokens, {dist.get_world_size()} processes, one thread each")
            names = [n for n in times if n != "rounds"]
            med = {n: statistics.median(times[n]) for n in names}
            names = [n.replace("alone", "unpatched step alone") for n in names]
            med["unpatched step alone"] = med["alone"]
            times["unpatched step alone"] = times["alone"]
            for n in names:
                print(f"{n:29s} median {med[n] * 1e3:.3f} ms  min {min(times[n]) * 1e3:.3f} ms")
            pairs = [(names[0], n) for n in names[1:]] + ([tuple(names[1:])] if len(names) == 3 else [])
            for a, b in pairs:
                ia, ib = names.index(a), names.index(b)
                ratios = sorted(r[ib] / r[ia] for r in times["rounds"])
                print(f"{b} / {a}: {med[b] / med[a]:.3f} (medians); per round {ratios[0]:.3f} .. {ratios[-1]:.3f}")
        hf_contextpar.remove_context_parallel(cp)
        return
    if args.ops:
        one = count_ops(ref, ids) if dist.get_rank() == 0 else None
        dist.barrier()
        two = count_ops(cp, ids)
        if dist.get_rank() == 0:
            show_ops(one, two)
        hf_contextpar.remove_context_parallel(cp)
        return
    one = decode_steps(ref, ids, args.steps, "step") if dist.get_rank() == 0 else None
    dist.barrier()
    two = decode_steps(cp, ids, args.steps, "step")
    if dist.get_rank() == 0:

        def show(v):
            v = sorted(v)
            return f"min {v[0] * 1e3:7.3f} ms  median {v[len(v) // 2] * 1e3:7.3f} ms  ({len(v)} calls)"

        print(f"{args.model}, {args.length} tokens, N = {dist.get_world_size()}, one thread a rank")
        print(f"unpatched step        {show(one['step'])}")
        for name in ("step", *(k for k in ORDER if k in two)):
            print(f"patched {name:22s}{show(two[name])}")
    hf_contextpar.remove_context_parallel(cp)


if __name__ == "__main__":
    main()
