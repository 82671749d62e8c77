"""Measure the cost model's machine facts, and check the planner's choices against measured timings.

`python -m hf_contextpar calibrate` (under torchrun) times the local attention kernel (C, in
FLOP/s), a matmul like the linear layers, a memory copy, the ring send/recv (BW, in bytes/s) and
one small collective (latency) on this machine and saves them where the planner looks; the benchmark
measures the same way (`measure`, `median_seconds`: one timing helper, device-synchronised).
`python -m hf_contextpar sweep` times ring pass-KV and ring pass-Q side by side
on partial prefills over a fixed total context at several KV-cache miss rates, reports which
was faster and what the planner chose, and refits the empirical h(T,P) from the timings.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from ..attention.kernels import attend
from ..cache.sharded import cache_argument, returned_cache
from ..plan.choice import choose, empirical_h, fit_h
from ..plan.costmodel import Shape
from ..plan.machine import Machine


def sync(device):
    """Wait for the device's queued work (CUDA kernels run asynchronously)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, repeats: int, device="cpu", barrier=None) -> float:
    """Median wall time of fn() after one warm-up; device work is synchronised on both sides, so
    asynchronous CUDA kernels are timed, not just launched."""
    fn()
    times = []
    for _ in range(repeats):
        if barrier:
            barrier()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def small_collective_s(numel: int, iters: int = 200, group=None, gather=None) -> float:
    """Median time of one small all-gather: the latency alpha, and decode's floor per layer.
    gather(out, t): the transport to time (default: the group's own all-gather)."""
    t = torch.zeros(numel)
    out = torch.empty(numel * dist.get_world_size(group))
    gather = gather or getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    times = []
    for i in range(iters + 20):
        t0 = time.perf_counter()
        gather(out, t, group=group)
        if i >= 20:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(
    shape: Shape,
    dtype=torch.float32,
    device="cpu",
    group=None,
    tokens: int = 2048,
    message_bytes: int = 1 << 22,
    repeats: int = 5,
) -> Machine:
    """The cost model's machine facts, measured here: C_attn on a fully visible block of the local
    kernel, C_gemm on a matmul the size of one layer's linear weights, and with a process group
    the ring bandwidth and one small collective's latency; every rank takes the minimum."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, shape.heads, tokens, shape.head_dim, generator=g).to(device, dtype)
    k = torch.randn(1, shape.kv_heads, tokens, shape.head_dim, generator=g).to(device, dtype)
    cols = torch.arange(tokens)
    t_attn = median_seconds(lambda: attend(q, k, k, cols + tokens, cols, scale=0.1), repeats, device)
    c_attn = 4 * tokens * tokens * shape.heads * shape.head_dim / t_attn
    # (tokens x hidden) @ (hidden x W/hidden) with a square-ish hidden: the layer's weight count
    hidden = max(64, int(round((shape.linear_weights / 6) ** 0.5)))
    a = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    w = torch.randn(hidden, max(1, shape.linear_weights // hidden), generator=g).to(device, dtype)
    c_gemm = 2 * tokens * hidden * w.shape[1] / median_seconds(lambda: a @ w, repeats, device)
    big = torch.empty(1 << 24, dtype=torch.float32, device=device)  # 64 MiB, past the caches
    mem_bw = 2 * big.numel() * 4 / median_seconds(lambda: big.clone(), repeats, device)  # read + write
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    bw, lat = float("inf"), 0.0
    if world > 1:
        rank = dist.get_rank(group)
        nxt, prv = (dist.get_global_rank(group or dist.group.WORLD, (rank + s) % world) for s in (1, -1))
        buf = torch.zeros(message_bytes // 4, device=device)
        recv = torch.empty_like(buf)

        def shift():
            for work in dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, buf, nxt, group), dist.P2POp(dist.irecv, recv, prv, group)]
            ):
                work.wait()

        bw = message_bytes / median_seconds(shift, repeats, device, barrier=lambda: dist.barrier(group=group))
        lat = small_collective_s(shape.heads * (shape.head_dim + 1), iters=100, group=group)
        mine = torch.tensor([c_attn, c_gemm, bw, -lat, mem_bw], dtype=torch.float64)
        everyone = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine, group=group)
        c_attn, c_gemm, bw, neg_lat, mem_bw = torch.stack(everyone).min(dim=0).values.tolist()
        lat = -neg_lat
    return Machine(
        attn_flops=c_attn,
        gemm_flops=c_gemm,
        bandwidth=bw,
        latency=lat,
        memory_bandwidth=mem_bw,
        source="measured",
        details=dict(
            world=world,
            tokens=tokens,
            message_bytes=message_bytes,
            threads=torch.get_num_threads(),
            dtype=str(dtype),
            device=str(device),
            heads=shape.heads,
            kv_heads=shape.kv_heads,
            head_dim=shape.head_dim,
        ),
    )


@torch.no_grad()
def miss_rate_sweep(model, runtime, total: int, rates, repeats: int = 3, device="cpu"):
    """Time pass-KV and pass-Q partial prefills of T = rate*total new tokens over P = total-T cached."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, total), generator=g).to(device)
    rows = []
    saved = runtime.settings
    try:
        for rate in rates:
            T = max(runtime.world, round(rate * total))
            P = total - T
            runtime.settings = replace(saved, strategy="ring_pass_kv")
            cache = returned_cache(model(ids[:, :P], use_cache=True, logits_to_keep=1)) if P else None
            cache_kw = {cache_argument(model): cache}  # named once, outside the timed call
            times = {}
            for s in ("ring_pass_kv", "ring_pass_q"):
                runtime.settings = replace(saved, strategy=s)

                def partial_prefill():
                    model(ids[:, P:], **cache_kw, use_cache=True, logits_to_keep=1)
                    if cache is not None:
                        cache.crop(P - cache.get_seq_length())

                times[s] = median_seconds(
                    partial_prefill, repeats, device, barrier=lambda: dist.barrier(group=runtime.comm.group)
                )
            d = choose(T, P, runtime.world, runtime.patched.shape, saved.calibration, saved.planner_rule)
            rows.append(
                dict(
                    miss_rate=T / total,
                    T=T,
                    P=P,
                    pass_kv_s=times["ring_pass_kv"],
                    pass_q_s=times["ring_pass_q"],
                    planner=d.strategy,
                    predicted_pass_kv_s=d.predicted_pass_kv_s,
                    predicted_pass_q_s=d.predicted_pass_q_s,
                )
            )
    finally:
        runtime.settings = saved
    for r in rows:
        faster = "ring_pass_kv" if r["pass_kv_s"] <= r["pass_q_s"] else "ring_pass_q"
        r["faster"] = faster
        r["planner_right"] = r["planner"] == faster
        r["planner_loss"] = (
            r[f"{'pass_kv' if r['planner'] == 'ring_pass_kv' else 'pass_q'}_s"] / min(r["pass_kv_s"], r["pass_q_s"]) - 1
        )
    coeffs = None
    usable = [(r["T"], r["P"], r["pass_kv_s"], r["pass_q_s"]) for r in rows if r["P"] > 0]
    if len(usable) >= 3:
        coeffs = fit_h(usable)
        for r in rows:
            r["empirical_refit"] = "ring_pass_kv" if empirical_h(r["T"], max(r["P"], 0), coeffs) > 0 else "ring_pass_q"
    return rows, coeffs


def format_sweep(rows, coeffs) -> str:
    lines = [
        "| miss rate | T | P | pass-KV ms | pass-Q ms | faster | planner (Alg.5) | planner loss | h refit |",
        "|---:|---:|---:|---:|---:|---|---|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['miss_rate']:.3f} | {r['T']} | {r['P']} | {r['pass_kv_s'] * 1e3:.1f} | {r['pass_q_s'] * 1e3:.1f} | "
            f"{r['faster']} | {r['planner']} | {r['planner_loss'] * 100:.1f}% | {r.get('empirical_refit', '-')} |"
        )
    if coeffs:
        lines.append(f"refit h(T,P) = {coeffs[0]:.3f} log T + {coeffs[1]:.3f} log(T/(T+P)) + {coeffs[2]:.3f}")
    return "\n".join(lines)


def _agreed(runtime, seconds: float) -> float:
    """The slowest rank's time: a prefill is done when every rank is."""
    t = torch.tensor([seconds], dtype=torch.float64)
    return float(runtime.comm.all_gather(t, tag="control").max())


@torch.no_grad()
def kvr_prefill_seconds(model, runtime, ids, sizes, repeats: int = 3) -> float:
    """Median TTFT (slowest rank) of a KV-Runahead prefill of `ids` with contiguous partition `sizes`."""
    from ..plan.partitions import PartitionTable

    table = PartitionTable(runtime.world)
    table.add(ids.shape[1], sizes)
    saved = runtime.settings
    runtime.settings = replace(saved, strategy="kv_runahead", partitions="table", partition_table=table)
    try:
        t = median_seconds(
            lambda: model(ids, use_cache=True, logits_to_keep=1),
            repeats,
            next(model.parameters()).device,
            barrier=lambda: dist.barrier(group=runtime.comm.group),
        )
    finally:
        runtime.settings = saved
    return _agreed(runtime, t)


def kvr_table(
    model, runtime, lengths, points: int = 5, repeats: int = 3, min_stride: int | None = None, device="cpu", log=None
):
    """KVR-S at each context length (hierarchical grid search on measured TTFT), as a PartitionTable."""
    from ..plan.partitions import PartitionTable, even, search

    table = PartitionTable(runtime.world, details=dict(points=points, repeats=repeats, threads=torch.get_num_threads()))
    g = torch.Generator().manual_seed(0)
    for length in lengths:
        ids = torch.randint(0, 256, (1, length), generator=g).to(device)
        sizes, seconds, measured = search(
            length,
            runtime.world,
            lambda s: kvr_prefill_seconds(model, runtime, ids, s, repeats),
            points=points,
            min_stride=min_stride,
        )
        table.add(length, sizes)
        even_s = measured[tuple(even(length, runtime.world))]
        table.details[str(length)] = dict(sizes=sizes, seconds=seconds, even_seconds=even_s, evaluated=len(measured))
        if log:
            log(
                f"T={length}: searched {sizes} {seconds * 1e3:.1f} ms vs even {even(length, runtime.world)} "
                f"{even_s * 1e3:.1f} ms ({len(measured)} partitions measured)"
            )
    return table
