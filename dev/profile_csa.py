"""CSA's prefill beside every exact strategy's, interleaved forward by forward (issue 41: TTFT at short prompts).

    torchrun --nproc_per_node 4 dev/profile_csa.py --lengths 2048,4096 --reps 8

`eval csa --exact-strategies all` times each setting's prompts one setting after the other, once each: on a
shared machine whose load drifts over its minutes that order moves the seconds more than the settings do. Here
every setting has its own copy of the model, applied once, and the forwards alternate (the order rotating each
round), so every setting sees the same load. Per length it prints each setting's median of the slowest rank's
prefill seconds and of the CPU seconds of all ranks, and CSA against the fastest exact strategy, both by medians
and as the median of each round's ratio to that round's fastest exact forward. A random prompt of each length
(partitions depend on the length alone; the pruning's cost not on the tokens).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import hf_contextpar
from hf_contextpar.models import load
from hf_contextpar.sparse import CSA


def setting(name: str, csa: CSA) -> dict:
    if name == "csa":
        return dict(sparse=csa)
    if name == "csa_even":
        return dict(sparse=csa, partitions="even")
    return dict(strategy=name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="needle-lm")
    p.add_argument("--lengths", default="2048,4096")
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--csa", default="0.6")
    p.add_argument("--topology", default="2x2")
    p.add_argument("--runs", default="csa,kv_runahead,ring_pass_kv,allgather_kv,ring_pass_q")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    csa, runs = CSA.parse(args.csa, topology=args.topology), args.runs.split(",")
    lengths = [int(x) for x in args.lengths.split(",")]
    models = {
        n: hf_contextpar.apply_context_parallel(load(args.model, torch.float32, "cpu")[0], **setting(n, csa))
        for n in runs
    }
    g = torch.Generator().manual_seed(0)
    ids = {t: torch.randint(5, 4000, (1, t), generator=g) for t in lengths}
    wall = {(n, t): [] for n in runs for t in lengths}
    cpu = {(n, t): [] for n in runs for t in lengths}
    with torch.no_grad():
        for t in lengths:  # warm: each layer's block geometry seen (receives posted ahead), partitions measured
            for n in runs:
                models[n](ids[t], use_cache=False, logits_to_keep=1)
        for r in range(args.reps):
            for t in lengths:
                for n in runs[r % len(runs) :] + runs[: r % len(runs)]:
                    dist.barrier()
                    c0, t0 = time.process_time(), time.perf_counter()
                    models[n](ids[t], use_cache=False, logits_to_keep=1)
                    wall[n, t].append(time.perf_counter() - t0)
                    cpu[n, t].append(time.process_time() - c0)
    every = [None] * world
    dist.all_gather_object(every, (wall, cpu))
    if rank == 0:
        report(every, runs, lengths, args.reps)


def report(every, runs, lengths, reps) -> None:
    med = statistics.median
    print(f"N = {len(every)}, {reps} rounds, lengths {lengths}: median seconds (slowest rank; CPU of all ranks)")
    for t in lengths:
        slow = {n: [max(w[n, t][i] for w, _ in every) for i in range(reps)] for n in runs}
        cpus = {n: [sum(c[n, t][i] for _, c in every) for i in range(reps)] for n in runs}
        print(f"T={t}: " + "  ".join(f"{n} {med(slow[n]):.3f} ({med(cpus[n]):.3f})" for n in runs))
        exact = [n for n in runs if not n.startswith("csa")]
        if "csa" in runs and exact:
            best = min(exact, key=lambda n: med(slow[n]))
            rounds = [slow["csa"][i] / min(slow[n][i] for n in exact) for i in range(reps)]
            print(
                f"   CSA / fastest exact ({best}): {med(slow['csa']) / med(slow[best]):.3f}; per round: "
                f"{med(rounds):.3f}; CPU: {med(cpus['csa']) / med(cpus[best]):.3f}"
            )


if __name__ == "__main__":
    main()
