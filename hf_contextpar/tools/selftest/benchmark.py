"""The self-test's short benchmark: prefill TTFT and decode TTIT at one length, N ranks against one
process, with the benchmark's own measurements (`hf_contextpar.tools.bench.measure.Samples`).

Rank 0 alone times the unpatched model with the same threads per process while the others wait,
then every rank times the patched model (the planner's strategy); medians of `repeats` after a
warm-up, the slowest rank's time for the context-parallel run. Informative: it is not part of the
verdict (timings depend on the machine and its load), but the greedy tokens of both runs are
reported.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..bench.measure import Samples


def run_benchmark(model_name, dtype, device, rank, world, *, length, new_tokens, repeats, strategy="auto") -> dict:
    import hf_contextpar

    from ...models import load

    model, _ = load(model_name, dtype, device)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = torch.randint(0, min(256, vocab), (1, length), generator=torch.Generator().manual_seed(0)).to(device)
    warm = ids[:, : min(256, length)]

    def measure(samples, stats=None, barrier=None):
        Samples().measure(model, warm, last=True, new_tokens=2, stats=stats, barrier=barrier, device=device)
        for rep in range(repeats):
            samples.measure(
                model, ids, last=rep == repeats - 1, new_tokens=new_tokens, stats=stats, barrier=barrier, device=device
            )
        return samples.summary()

    single = measure(Samples()) if rank == 0 else None
    dist.barrier()
    hf_contextpar.apply_context_parallel(model, strategy=strategy)
    try:
        runtime = hf_contextpar.get_runtime(model)
        mine = measure(Samples(), stats=runtime.comm.stats, barrier=dist.barrier)
        algorithms = dict(runtime.algorithm_counts)
    finally:
        hf_contextpar.remove_context_parallel(model)
    everyone = [None] * world
    dist.all_gather_object(everyone, dict(ttft_s=mine["ttft_s"], ttit_s=mine["ttit_s"], tokens=mine["tokens"]))
    if rank != 0:
        return {}
    ttft, ttit = max(e["ttft_s"] for e in everyone), max(e["ttit_s"] for e in everyone)
    return dict(
        length=length,
        new_tokens=new_tokens,
        repeats=repeats,
        strategy=strategy,
        dtype=str(dtype).split(".")[-1],
        algorithms=algorithms,
        threads_per_process=torch.get_num_threads(),
        cp=dict(ttft_s=ttft, ttit_s=ttit),
        one_process=dict(ttft_s=single["ttft_s"], ttit_s=single["ttit_s"]),
        ttft_speedup=single["ttft_s"] / ttft,
        ttit_ratio=ttit / single["ttit_s"],
        tokens_identical=everyone[0]["tokens"] == single["tokens"],
    )
