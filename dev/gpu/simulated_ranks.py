"""Model-level figures on one GPU: each rank of an N-rank run, alone, on torch's fake process group.

    python -m dev.gpu.simulated_ranks --geometry llama-1b --lengths 32768,65536,131072 --worlds 2,4 --json X
    python -m dev.gpu.simulated_ranks --profile 32768,2 --no-cudnn      # where a decode step's host time goes

One GPU hosts one NCCL rank, so N ranks cannot run side by side on it. torch's `fake` backend lets one
process join an N-rank group as rank r: every collective returns at once, an all-gather filling each slot
with this rank's own tensor, a receive leaving its buffer as it was. The patched model then runs rank r's
real work: its shard of the prompt through every layer, the library's hooks, plan, kernels and merges, its
1/N of the KV cache, and in decode the local attention over that 1/N and the merge of N partials. The
communication is free (an ideal link: no transfer, no wait) and what arrives is a stand-in. Shapes and
masks come from the replicated plan, never from received data, so the work is the real rank's. The
values and tokens are not the model's; exactness is `selftest --simulated` and the CPU suite's business.

Each rank runs on its own, one after another, as it would on its own GPU. A figure is the slowest rank
against the unpatched model on the same GPU in the same run: the speed-up N GPUs reach before any
communication. The bytes each rank would have sent are printed beside it, so a link's cost can be added.
Random weights in the named geometry (a 1B or 8B Llama), bf16, SDPA.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.distributed as dist
import transformers
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_contextpar
from hf_contextpar.models import tiny_model
from hf_contextpar.tools.bench import measure
from hf_contextpar.tools.calibrate import sync
from hf_contextpar.tools.presets import GEOMETRIES as PRESET_GEOMETRIES

# the published geometries of hf_contextpar.tools.presets, by short names; "tiny": the test matrix's tiny Llama
GEOMETRIES = {"llama-1b": "llama-3.2-1b", "llama-8b": "llama-3.1-8b", "tiny": None}


def build(geometry: str, device, dtype):
    """Random weights in the geometry, seeded, on `device` (the tiny one built on the CPU and moved)."""
    if GEOMETRIES[geometry] is None:
        return tiny_model("llama", dtype=dtype).to(device)
    config = LlamaConfig(**PRESET_GEOMETRIES[GEOMETRIES[geometry]], max_position_embeddings=131072, rope_theta=5e5)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def timed(model, ids, new_tokens, repeats, device, stats=None):
    """Median TTFT over `repeats` prefills (after one warm-up) and median TTIT over the last's decode."""
    ttft, last = [], None
    for i in range(repeats + 1):
        pre, cache, token = measure.prefill(model, ids, stats=stats, device=device)
        if i:
            ttft.append(pre["ttft_s"])
        last = pre
        if i < repeats:
            del cache
    dec = measure.decode(cache, token, model, new_tokens=new_tokens, device=device)
    return dict(
        ttft_s=statistics.median(ttft), ttit_s=dec["ttit_s"], kv_bytes=dec["kv_bytes"], bytes_sent=last["bytes_sent"]
    )


def as_rank(rank: int, world: int):
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def profile_decode(model, length: int, world: int, device) -> None:
    """Top ops of five decode steps, one process's then rank 0 of `world`'s, after a prefill of `length`."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0)).to(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for who in ("one process", f"rank 0 of {world}"):
        if who != "one process":
            as_rank(0, world)
            hf_contextpar.apply_context_parallel(model)
        _, cache, token = measure.prefill(model, ids, device=device)
        measure.decode(cache, token, model, new_tokens=4, device=device)
        with profile(activities=activities) as prof:
            steps = measure.decode(cache, token, model, new_tokens=6, device=device)["ttit_all_s"]
        print(f"{who}: decode steps {[round(x * 1e3, 2) for x in steps]} ms")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=45))
        if who != "one process":
            hf_contextpar.remove_context_parallel(model)


def _sdpa(cudnn) -> str:
    return {True: "SDPA with its cuDNN backend", False: "SDPA without its cuDNN backend"}.get(cudnn, "SDPA")


def _tokens(t: int) -> str:
    return f"{t // 1024}K" if t % 1024 == 0 else str(t)


def markdown(report: dict) -> str:
    """A run's table for docs/benchmarks.md (dev/benchmarks_page.py)."""
    head = (
        f"**{report['geometry']}**, {report['dtype']}, {report['device']}, torch {report['torch']}, transformers "
        f"{report['transformers']}, {_sdpa(report['cudnn'])}, "
        f"strategy {report['strategy']}"
    )
    lines = [
        head,
        "",
        "| T | N | one process TTFT (s) | slowest rank TTFT (s) | prefill speed-up | one process TTIT (ms) "
        "| slowest rank TTIT (ms) | TTIT ratio | KV per rank | sent per rank (MiB) | link to hide it (GB/s) | algorithms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        per = r["ranks"]
        algos = ", ".join(sorted({a for x in per for a in x["algorithms"]}))
        sent, slowest = max(x["bytes_sent"] for x in per), max(x["ttft_s"] for x in per)
        lines.append(
            f"| {_tokens(r['length'])} | {r['world']} | {r['one']['ttft_s']:.3f} | {max(x['ttft_s'] for x in per):.3f} "
            f"| {r['prefill_speedup']:.2f}x | {r['one']['ttit_s'] * 1e3:.1f} | {max(x['ttit_s'] for x in per) * 1e3:.1f} "
            f"| {r['ttit_ratio']:.2f} | {r['kv_fraction']:.3f} | {sent / 2**20:.0f} | {sent / slowest / 1e9:.1f} | {algos} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--geometry", default="llama-1b", choices=sorted(GEOMETRIES))
    p.add_argument("--lengths", default="32768,65536,131072")
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--strategy", default="auto")
    p.add_argument("--ranks", default="all", help="'all' or 'ends' (rank 0 and N-1 only)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=17)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument(
        "--no-cudnn",
        action="store_true",
        help="SDPA without its cuDNN backend (on torch 2.11 it "
        "builds a graph per decode step: 2.5 ms of host time per layer, as the key length grows)",
    )
    p.add_argument("--profile", metavar="T,N", help="profile decode steps at length T, one process and rank 0 of N")
    p.add_argument("--json")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.no_cudnn:
        torch.backends.cuda.enable_cudnn_sdp(False)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    as_rank(1, 2)  # the stand-ins: an all-gather must fill each slot with this rank's tensor (agreements pass)
    x = torch.arange(3.0, device=device)
    got = torch.full((6,), -1.0, device=device)
    dist.all_gather_into_tensor(got, x)
    if not torch.equal(got.cpu(), torch.arange(3.0).repeat(2)):
        raise SystemExit(f"this torch's fake all-gather leaves its output as {got.tolist()}: no stand-ins")
    model = build(args.geometry, device, dtype)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(
        f"{args.geometry}, {args.dtype}, {name}, torch {torch.__version__}; strategy {args.strategy}"
        f"{'; SDPA without cuDNN' if args.no_cudnn else ''}",
        flush=True,
    )
    if args.profile:
        length, world = (int(x) for x in args.profile.split(","))
        return profile_decode(model, length, world, device)
    rows = []
    for t in [int(x) for x in args.lengths.split(",")]:
        ids = torch.randint(0, model.config.vocab_size, (1, t), generator=torch.Generator().manual_seed(t)).to(device)
        one = timed(model, ids, args.new_tokens, args.repeats, device)
        print(
            f"T={t}: one process TTFT {one['ttft_s']:.3f} s, TTIT {one['ttit_s'] * 1e3:.2f} ms, "
            f"KV {one['kv_bytes'] / 2**30:.2f} GiB",
            flush=True,
        )
        for n in [int(x) for x in args.worlds.split(",")]:
            ranks = range(n) if args.ranks == "all" else sorted({0, n - 1})
            per = []
            for r in ranks:
                as_rank(r, n)
                hf_contextpar.apply_context_parallel(model, strategy=args.strategy)
                rt = hf_contextpar.get_runtime(model)
                res = timed(model, ids, args.new_tokens, args.repeats, device, stats=rt.comm.stats)
                res.update(rank=r, algorithms=dict(rt.algorithm_counts))
                per.append(res)
                hf_contextpar.remove_context_parallel(model)
                sync(device)
            slow_pre = max(x["ttft_s"] for x in per)
            slow_dec = max(x["ttit_s"] for x in per)
            row = dict(
                length=t,
                world=n,
                one=one,
                ranks=per,
                prefill_speedup=one["ttft_s"] / slow_pre,
                ttit_ratio=slow_dec / one["ttit_s"],
                kv_fraction=max(x["kv_bytes"] for x in per) / one["kv_bytes"],
            )
            rows.append(row)
            algos = sorted({a for x in per for a in x["algorithms"]})
            print(
                f"  N={n} ({', '.join(algos)}): slowest rank TTFT {slow_pre:.3f} s = {row['prefill_speedup']:.2f}x "
                f"faster; TTIT {slow_dec * 1e3:.2f} ms = {row['ttit_ratio']:.2f}x one process; KV per rank "
                f"{row['kv_fraction']:.3f} of one; sent per rank {max(x['bytes_sent'] for x in per) / 2**20:.0f} MiB",
                flush=True,
            )
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if dist.is_initialized():
        dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as f:
            meta = dict(
                geometry=args.geometry,
                dtype=args.dtype,
                device=name,
                torch=torch.__version__,
                transformers=transformers.__version__,
                cudnn=None if device.type != "cuda" else not args.no_cudnn,
                strategy=args.strategy,
            )
            json.dump(dict(meta, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
