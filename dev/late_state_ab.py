"""The state chain with and without Gated DeltaNet's late state (patches/gated_delta.py), prefills interleaved.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 dev/late_state_ab.py [T] [ROUNDS] [STRATEGY]

On a shared machine two separate runs differ by more than what is measured here (one process's 16K prefill
read 15.6 s and 16.8 s in two bench runs minutes apart). So one pair of processes runs both: each round one
prefill with the kernel taking the passed state late, one with the patch's wrappers swapped out (the state
read at the mixer's start, as before), in alternating order; a rank's wait for states and its TTFT per
variant, medians over rounds, and one process's prefill (rank 0 alone, rank 1 waiting at a barrier) each
round for the speed-up. The first prefill of each variant is a warm-up (the balanced partitions' measured fit).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist
from hf_contextpar.patches import wrapping

import hf_contextpar
from hf_contextpar.models import tiny_model


def swapped_out():
    """Put the originals back for a while: the state is read where the mixer reads it."""
    saved = {(owner, name): getattr(owner, name) for owner, name in wrapping.wrapped()}
    for owner, name in saved:
        setattr(owner, name, wrapping.original(owner, name))
    return lambda: [setattr(owner, name, value) for (owner, name), value in saved.items()]


def main(length: int = 16384, rounds: int = 4, strategy: str = "kv_runahead"):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = tiny_model("qwen3_next_hybrid")
    ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(0))
    one = []
    with torch.no_grad():
        for _ in range(rounds):
            dist.barrier()
            if rank == 0:
                start = time.perf_counter()
                model(input_ids=ids, use_cache=True, logits_to_keep=1)
                one.append(time.perf_counter() - start)
        dist.barrier()
    hf_contextpar.apply_context_parallel(model, strategy=strategy)
    stats = hf_contextpar.get_runtime(model).comm.stats
    times = {"late": [], "at start": []}
    waits = {"late": [], "at start": []}
    with torch.no_grad():
        for r in range(rounds + 1):
            for variant in ["late", "at start"] if r % 2 == 0 else ["at start", "late"]:
                restore = swapped_out() if variant == "at start" else (lambda: None)
                try:
                    dist.barrier()
                    before = stats.waits.get("state_recv", 0.0)
                    start = time.perf_counter()
                    model(input_ids=ids, use_cache=True, logits_to_keep=1)
                    took = torch.tensor([time.perf_counter() - start])
                finally:
                    restore()
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                wait = stats.waits.get("state_recv", 0.0) - before
                if r > 0:
                    times[variant].append(took.item())
                    waits[variant].append(wait)
    if rank == 0:
        base = statistics.median(one)
        print(f"T={length} N=2 {strategy}, {rounds} rounds; one process {base:.2f} s {[round(t, 2) for t in one]}")
    for variant in times:
        ttft = statistics.median(times[variant])
        line = f"rank {rank} {variant:>8}: TTFT {ttft:.2f} s {[round(t, 2) for t in times[variant]]}, state waits "
        line += f"{statistics.median(waits[variant]):.2f} s"
        print(line + (f", speed-up {base / ttft:.3f}x" if rank == 0 else ""), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]), *sys.argv[3:4])
