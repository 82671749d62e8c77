"""`python -m hf_contextpar.bench`: prefill and decode latency, KV memory and traffic per strategy.

    torchrun --nproc_per_node 2 -m hf_contextpar.bench --lengths 4096,8192,16384 --out bench/
    python -m hf_contextpar.bench --lengths 4096,8192,16384 --out bench/      # N = 1, same DIR: merged

N is the world size. For every strategy and prompt length it measures, on every rank: TTFT (one
prefill forward plus the argmax, median of --repeats after a warm-up), TTIT (median decode step),
KV-cache bytes, peak RSS, bytes sent/received and the time blocked in communication
(`runtime.comm.stats.wait_s`: the exposed communication). In the same run, rank 0 alone times the
unpatched model with the same threads per process and with all cores (the others wait), and the
greedy tokens of every strategy are checked against it. A small all-gather is timed to give the
decode floor (one per layer), and C, BW and the collective latency feed the roofline cost model
(`costmodel`), printed next to the measurement. Rows for other world sizes already in
DIR/bench.json are kept, so an N=1 and an N=2 run fill one table and one set of plots.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from . import costmodel
from .cli import DTYPES, load

DEFAULT_MODEL = "needle-lm"
BASELINES = ("unpatched", "unpatched_all_cores")


# -- measurement helpers -----------------------------------------------------------------------
def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _rss() -> tuple[int, int]:
    """(current, peak) resident set size in bytes; (0, 0) where /proc is missing."""
    try:
        fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError):
        return 0, 0


def _reset_peak(device):
    """Start a new peak-memory window: CUDA allocator stats, or Linux's VmHWM (clear_refs 5)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak(device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _rss()[1]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _kv_bytes(cache) -> int:
    if hasattr(cache, "local_nbytes"):
        return cache.local_nbytes()
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


@torch.no_grad()
def prefill(model, ids, *, stats=None, barrier=None, device):
    """One timed prefill (forward over the prompt + argmax of the last logits): TTFT and its traffic."""
    if barrier:
        barrier()
    if stats is not None:
        stats.reset()
    c0, t0 = time.process_time(), time.perf_counter()
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    _sync(device)
    res = dict(ttft_s=time.perf_counter() - t0, ttft_cpu_s=time.process_time() - c0, comm_wait_s=0.0,
               comm_wait_by_op_s={}, bytes_sent=0, bytes_received=0)
    if stats is not None:
        res.update(comm_wait_s=stats.wait_s, comm_wait_by_op_s=dict(stats.waits), bytes_sent=stats.bytes_sent,
                   bytes_received=stats.bytes_received)
    return res, out.past_key_values, token


@torch.no_grad()
def decode(cache, token, model, *, new_tokens: int, stats=None, barrier=None, device):
    """`new_tokens - 1` timed greedy decode steps after a prefill; per-step times and the tokens."""
    tokens, steps, waits = [int(token[0, 0])], [], []
    if barrier:
        barrier()
    for _ in range(new_tokens - 1):
        if stats is not None:
            stats.reset()
        t0 = time.perf_counter()
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        _sync(device)
        steps.append(time.perf_counter() - t0)
        tokens.append(int(token[0, 0]))
        if stats is not None:
            waits.append(stats.wait_s)
    return dict(ttit_s=_median(steps), ttit_all_s=steps, decode_comm_wait_s=_median(waits) if waits else 0.0,
                tokens=tokens, kv_bytes=_kv_bytes(cache))


class CombinedStats:
    """The attention traffic (`runtime.comm`) and the control traffic (`runtime.control`: input check,
    logits gather) read as one; control operations are reported as 'control <op>'."""

    def __init__(self, runtime):
        self.parts = [("", runtime.comm.stats)]
        if getattr(runtime, "control", None) is not None and runtime.control is not runtime.comm:
            self.parts.append(("control ", runtime.control.stats))

    def reset(self):
        for _, st in self.parts:
            st.reset()

    @property
    def wait_s(self):
        return sum(st.wait_s for _, st in self.parts)

    @property
    def waits(self):
        return {prefix + op: w for prefix, st in self.parts for op, w in st.waits.items()}

    @property
    def bytes_sent(self):
        return sum(st.bytes_sent for _, st in self.parts)

    @property
    def bytes_received(self):
        return sum(st.bytes_received for _, st in self.parts)


class Samples:
    """Repeated prefill + decode of one configuration: TTFT median over prefills, TTIT over every step."""

    def __init__(self):
        self.prefills, self.steps, self.step_waits, self.final = [], [], [], {}

    def measure(self, model, ids, *, last: bool, new_tokens: int, stats=None, barrier=None, device):
        rss0 = _rss()[0]
        if last:
            _reset_peak(device)
        res, cache, token = prefill(model, ids, stats=stats, barrier=barrier, device=device)
        self.prefills.append(res)
        dec = decode(cache, token, model, new_tokens=new_tokens, stats=stats, barrier=barrier, device=device)
        self.steps += dec["ttit_all_s"]
        self.step_waits.append(dec["decode_comm_wait_s"])
        if last:  # peak, KV bytes and tokens of the last repeat (every repeat computes the same)
            self.final = dec
            peak = _peak(device)
            self.final.update(peak_bytes=peak, peak_delta_bytes=max(0, peak - rss0) if device.type == "cpu" else peak)

    def summary(self) -> dict:
        med = {k: _median([p[k] for p in self.prefills])
               for k in ("ttft_s", "ttft_cpu_s", "comm_wait_s")}
        ops = {op for p in self.prefills for op in p["comm_wait_by_op_s"]}
        return dict(**{**self.final, "ttit_s": _median(self.steps), "ttit_all_s": self.steps,
                       "decode_comm_wait_s": _median(self.step_waits)},
                    **med, ttft_all_s=[p["ttft_s"] for p in self.prefills],
                    comm_wait_by_op_s={op: _median([p["comm_wait_by_op_s"].get(op, 0.0) for p in self.prefills]) for op in ops},
                    bytes_sent=self.prefills[-1]["bytes_sent"], bytes_received=self.prefills[-1]["bytes_received"])


def small_collective_s(numel: int, iters: int = 200) -> float:
    """Median time of one small all-gather on the default group: the decode floor per layer."""
    t = torch.zeros(numel)
    out = torch.empty(numel * dist.get_world_size())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    times = []
    for i in range(iters + 20):
        t0 = time.perf_counter()
        gather(out, t)
        if i >= 20:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def small_collective_after_compute_s(numel: int, iters: int = 200) -> float:
    """The same all-gather when each one follows ~1 ms of compute, as in decode: the peers' gloo
    threads have gone to sleep and must be woken, which back-to-back calls never pay."""
    t = torch.zeros(numel)
    out = torch.empty(numel * dist.get_world_size())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    a, b = torch.randn(64, 256), torch.randn(256, 1024)

    def compute_only():
        t0 = time.perf_counter()
        a @ b
        a @ b
        return time.perf_counter() - t0

    def with_gather():
        t0 = time.perf_counter()
        a @ b
        a @ b
        gather(out, t)
        return time.perf_counter() - t0

    dist.barrier()
    base = statistics.median(compute_only() for _ in range(iters))
    dist.barrier()
    both = statistics.median(with_gather() for _ in range(iters))
    return max(0.0, both - base)


def measure_machine(shape: costmodel.Shape, dtype, device, world: int, tokens: int = 2048) -> costmodel.Machine:
    """C_attn, C_gemm, and (N >= 2) ring bandwidth and small-collective latency; min over ranks."""
    from .kernels import attend

    def timed(fn, n=3):
        fn()
        out = []
        for _ in range(n):
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            out.append(time.perf_counter() - t0)
        return statistics.median(out)

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, shape.heads, tokens, shape.head_dim, generator=g).to(device, dtype)
    k = torch.randn(1, shape.kv_heads, tokens, shape.head_dim, generator=g).to(device, dtype)
    cols = torch.arange(tokens)
    c_attn = 4 * tokens * tokens * shape.heads * shape.head_dim / timed(lambda: attend(q, k, k, cols + tokens, cols, scale=0.1))
    # a matmul with the layer's weight count, as (tokens x hidden) @ (hidden x W/hidden) for a square-ish hidden
    hidden = max(64, int(round((shape.linear_weights / 6) ** 0.5)))
    a = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    w = torch.randn(hidden, shape.linear_weights // hidden, generator=g).to(device, dtype)
    c_gemm = 2 * tokens * hidden * w.shape[1] / timed(lambda: a @ w)
    bw, lat = float("inf"), 0.0
    if world > 1:
        lat = small_collective_s(shape.heads * (shape.head_dim + 1), iters=100)
        buf = torch.zeros(1 << 20, device=device)  # 4 MiB, a ring message of the size a 16K prefill sends
        nxt, prv = (dist.get_rank() + 1) % world, (dist.get_rank() - 1) % world
        recv = torch.empty_like(buf)

        def shift():
            for w_ in dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, nxt), dist.P2POp(dist.irecv, recv, prv)]):
                w_.wait()

        dist.barrier()
        bw = buf.numel() * buf.element_size() / timed(shift, n=5)
        vals = [torch.zeros(4, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(vals, torch.tensor([c_attn, c_gemm, bw, -lat], dtype=torch.float64))
        c_attn, c_gemm, bw, neg_lat = torch.stack(vals).min(dim=0).values.tolist()
        lat = -neg_lat
    return costmodel.Machine(c_attn, c_gemm, bw, lat)


# -- the run ---------------------------------------------------------------------------------------
KVR_TABLE = "kv_runahead_table"  # a row of its own: KV-Runahead with --kvr-partitions, next to even partitions


def _strategies(requested: str | None) -> list[str]:
    from .api import STRATEGIES

    if not requested:
        return [s for s in STRATEGIES if s != "auto"]
    names = [s.strip() for s in requested.split(",") if s.strip()]
    bad = [s for s in names if s not in STRATEGIES]
    if bad:
        raise SystemExit(f"unknown strategies {bad}; this build has {list(STRATEGIES)}")
    return names


def _gather(obj, world):
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _row(kind, strategy, world, length, threads, per_rank: list[dict]):
    """One table row: scalar timings from rank 0 (identical work on every rank), per-rank lists for the rest."""
    r0 = per_rank[0]
    row = dict(kind=kind, strategy=strategy, N=world, length=length, threads_per_rank=threads,
               ttft_s=max(p["ttft_s"] for p in per_rank), ttft_all_s=r0["ttft_all_s"],
               ttit_s=max(p["ttit_s"] for p in per_rank), ttit_all_s=r0["ttit_all_s"])
    for key in ("kv_bytes", "peak_bytes", "peak_delta_bytes", "bytes_sent", "bytes_received", "comm_wait_s",
                "comm_wait_by_op_s", "decode_comm_wait_s", "ttft_cpu_s"):
        row[f"{key}_per_rank"] = [p[key] for p in per_rank]
    row["comm_wait_frac"] = max(row["comm_wait_s_per_rank"]) / row["ttft_s"] if row["ttft_s"] > 0 else 0.0
    row["tokens"] = r0["tokens"]
    return row


def run(args) -> dict | None:
    import hf_contextpar

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cores = _cores()
    threads = args.threads or max(1, cores // world)
    torch.set_num_threads(threads)
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu")
    if world > 1 and not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo")
    barrier = dist.barrier if world > 1 else None
    dtype = DTYPES[args.dtype]
    model, _ = load(args.model, dtype, device)
    shape = costmodel.Shape.from_model(model)
    lengths = sorted(int(x) for x in args.lengths.split(","))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(256, model.config.get_text_config(decoder=True).vocab_size), (1, max(lengths)),
                        generator=g).to(device)
    strategies = _strategies(args.strategies)
    if args.kvr_partitions and "kv_runahead" in strategies:
        strategies.append(KVR_TABLE)
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if rank == 0 else (lambda *a: None)
    log(f"bench: model {args.model}  N={world}  threads/rank {threads}  cores {cores}  lengths {lengths}  "
        f"strategies {strategies}")

    machine = measure_machine(shape, dtype, device, world)
    floor_collective = small_collective_s(shape.heads * (shape.head_dim + 1)) if world > 1 else 0.0
    woken_collective = small_collective_after_compute_s(shape.heads * (shape.head_dim + 1)) if world > 1 else 0.0
    log(f"machine: C_attn {machine.attn_flops / 1e9:.2f} GFLOP/s  C_gemm {machine.gemm_flops / 1e9:.2f} GFLOP/s  "
        f"BW {machine.bandwidth / 1e9:.3f} GB/s  small collective {floor_collective * 1e3:.3f} ms "
        f"({woken_collective * 1e3:.3f} ms after compute)")

    rows, skipped = [], []
    warm = ids[:, : min(256, lengths[0])]
    baselines = [("unpatched", threads)]
    if cores != threads and not args.no_all_cores:  # with threads == cores the first baseline is this one
        baselines.append(("unpatched_all_cores", cores))

    def baseline(n_threads, fn):
        """Rank 0 runs the unpatched model with n_threads; the other ranks wait (blocked, not spinning)."""
        if rank == 0:
            torch.set_num_threads(n_threads)
            fn()
            torch.set_num_threads(threads)
        if barrier:
            barrier()

    def patched(strategy, fn):
        extra = {}
        if strategy == KVR_TABLE:  # KV-Runahead with the table's interpolated partitions (KVR-P)
            strategy, extra = "kv_runahead", dict(kvr_partitions=args.kvr_partitions)
        hf_contextpar.apply_context_parallel(model, strategy=strategy, **extra)
        try:
            runtime = hf_contextpar.get_runtime(model)
            fn(CombinedStats(runtime) if runtime is not None else None)
        finally:
            hf_contextpar.remove_context_parallel(model)

    # Warm-up every configuration once (allocator, process-group connections) and drop the strategies
    # this model cannot run.
    for kind, n_threads in baselines:
        baseline(n_threads, lambda: Samples().measure(model, warm, last=True, new_tokens=2, device=device))
    active = []
    for strategy in strategies:
        try:
            patched(strategy, lambda st: Samples().measure(model, warm, last=True, new_tokens=2, stats=st,
                                                           barrier=barrier, device=device))
            active.append(strategy)
        except (ValueError, NotImplementedError, hf_contextpar.ContextParallelError) as e:
            skipped.append(dict(strategy=strategy, N=world, reason=f"{type(e).__name__}: {e}"))
            log(f"  {strategy}: skipped ({type(e).__name__}: {e})")
            if barrier:
                barrier()

    # Side by side: every configuration once per round, so slow drifts in machine load hit all of them alike.
    for length in lengths:
        x = ids[:, :length]
        samples = {c: Samples() for c in [b[0] for b in baselines] + active}
        for rep in range(args.repeats):
            last = rep == args.repeats - 1
            for kind, n_threads in baselines:
                baseline(n_threads, lambda: samples[kind].measure(model, x, last=last, new_tokens=args.new_tokens,
                                                                  device=device))
            for strategy in active:
                patched(strategy, lambda st: samples[strategy].measure(model, x, last=last, new_tokens=args.new_tokens,
                                                                       stats=st, barrier=barrier, device=device))
        for kind, n_threads in baselines:
            if rank == 0:
                rows.append(_row("baseline", kind, 1, length, n_threads, [samples[kind].summary()]))
        for strategy in active:
            rows.append(_row("cp", strategy, world, length, threads, _gather(samples[strategy].summary(), world)))
        for r in rows:
            if r["length"] == length:
                log(f"  {r['strategy']:22s} N={r['N']} threads {r['threads_per_rank']}  T={length:6d}  "
                    f"TTFT {r['ttft_s'] * 1e3:9.1f} ms  TTIT {r['ttit_s'] * 1e3:7.2f} ms  comm wait "
                    f"{r['comm_wait_frac'] * 100:5.1f}%")

    if rank != 0:
        return None
    run_info = dict(N=world, threads_per_rank=threads, cores=cores, model=args.model, dtype=args.dtype,
                    device=str(device), repeats=args.repeats, new_tokens=args.new_tokens, lengths=lengths,
                    machine=machine.as_dict(), small_collective_s=floor_collective,
                    decode_floor_s=shape.layers * floor_collective,
                    small_collective_after_compute_s=woken_collective, shape=shape.__dict__,
                    load_before=os.getloadavg(), torch=torch.__version__, skipped=skipped,
                    kvr_partitions=args.kvr_partitions)
    _annotate(rows, run_info, shape, machine)
    report = _merge(os.path.join(args.out, "bench.json"), run_info, rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(report, f, indent=1)
    md = format_report(report)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(md)
    if not args.no_plots:
        report["plots"] = plot(report, args.out)
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump(report, f, indent=1)
    print(md, flush=True)
    return report


def _annotate(rows, run_info, shape, machine):
    """Predictions, speed-ups against this run's baselines, token agreement, KV bound."""
    base = {(r["strategy"], r["length"]): r for r in rows if r["kind"] == "baseline"}
    token_bytes = 2 * shape.kv_heads * shape.head_dim * shape.elem_bytes * shape.layers  # one token, every layer
    for r in rows:
        r["run_N"] = run_info["N"]
        r["predicted_ttft_s"] = costmodel.predict_ttft(r["strategy"] if r["kind"] == "cp" else "unpatched", r["length"],
                                                       r["N"], shape, machine)
        if r["kind"] == "baseline" and r["strategy"] == "unpatched_all_cores":
            r["predicted_ttft_s"] = None  # the machine constants are per rank (run's threads)
        one, allc = base.get(("unpatched", r["length"])), base.get(("unpatched_all_cores", r["length"]))
        if allc is None and run_info["threads_per_rank"] == run_info["cores"]:
            allc = one
        if one is not None:
            r["speedup_vs_unpatched"] = one["ttft_s"] / r["ttft_s"]
            # CPU time is what contention from other processes does not inflate: the efficiency of the work itself
            r["cpu_speedup_vs_unpatched"] = one["ttft_cpu_s_per_rank"][0] / max(r["ttft_cpu_s_per_rank"])
            r["ttit_ratio_vs_unpatched"] = r["ttit_s"] / one["ttit_s"]
            r["decode_overhead_s"] = r["ttit_s"] - one["ttit_s"]
            r["tokens_match_unpatched"] = r["tokens"] == one["tokens"]
            r["kv_bound_bytes"] = one["kv_bytes_per_rank"][0] / r["N"] + token_bytes
            r["kv_within_bound"] = max(r["kv_bytes_per_rank"]) <= r["kv_bound_bytes"]
        if allc is not None:
            r["speedup_vs_unpatched_all_cores"] = allc["ttft_s"] / r["ttft_s"]


def _merge(path, run_info, rows):
    """Keep rows (and run info) of other world sizes from an earlier run into the same DIR."""
    runs, kept = {}, []
    if os.path.exists(path):
        try:
            old = json.load(open(path))
            runs = {int(k): v for k, v in old.get("runs", {}).items()}
            kept = [r for r in old.get("rows", []) if r.get("run_N") != run_info["N"]]
        except (OSError, ValueError):
            pass
    runs[run_info["N"]] = run_info
    all_rows = sorted(kept + rows, key=lambda r: (r["run_N"], r["kind"] != "baseline", r["strategy"], r["length"]))
    report = dict(runs={str(k): v for k, v in sorted(runs.items())}, rows=all_rows)
    report["targets"] = check_targets(report)
    return report


# -- targets and report --------------------------------------------------------------------------
def check_targets(report) -> list[dict]:
    """The issue's targets, evaluated on the largest measured length of each run."""
    out = []
    for n_key, info in report["runs"].items():
        N = int(n_key)
        rows = [r for r in report["rows"] if r["run_N"] == N]
        if not rows:
            continue
        T = max(r["length"] for r in rows)
        at = {r["strategy"]: r for r in rows if r["length"] == T}
        cps = [r for r in rows if r["kind"] == "cp" and r["length"] == T]
        if N == 1:
            for r in cps:
                dt, di = r.get("speedup_vs_unpatched"), r.get("ttit_ratio_vs_unpatched")
                if dt is None:
                    continue
                ok = abs(1 / dt - 1) <= 0.03 and abs(di - 1) <= 0.03
                out.append(dict(target=f"N=1 patched ({r['strategy']}) vs unpatched within 3% (T={T})", met=ok,
                                figure=f"TTFT x{1 / dt:.3f}, TTIT x{di:.3f}"))
            continue
        for r in cps:
            s = r["strategy"]
            if r.get("speedup_vs_unpatched") is not None:
                ok = r["speedup_vs_unpatched"] >= 1.8 and r.get("speedup_vs_unpatched_all_cores", 1.0) >= 1.0
                out.append(dict(target=f"prefill {s} N={N} T={T}: >=1.8x vs 1-process same threads, >=1x vs all cores",
                                met=ok, figure=f"{r['speedup_vs_unpatched']:.2f}x / "
                                                f"{r.get('speedup_vs_unpatched_all_cores', float('nan')):.2f}x "
                                                f"(CPU-time speed-up {r['cpu_speedup_vs_unpatched']:.2f}x)"))
                floor = info["decode_floor_s"]
                over = r["decode_overhead_s"]
                woken = info.get("small_collective_after_compute_s", 0.0) * info["shape"]["layers"]
                out.append(dict(target=f"decode {s} N={N} T={T}: overhead <= 1.1 x floor ({floor * 1e3:.2f} ms)",
                                met=over <= 1.1 * floor,
                                figure=f"overhead {over * 1e3:.2f} ms = {over / floor if floor else float('nan'):.2f} x floor "
                                       f"({over / woken if woken else float('nan'):.2f} x the after-compute floor "
                                       f"{woken * 1e3:.2f} ms); "
                                       f"TTIT(N={N})/TTIT(1) = {r['ttit_ratio_vs_unpatched']:.2f}"))
                out.append(dict(target=f"KV bytes per rank {s} N={N} T={T}: <= single/N + one token per layer",
                                met=r["kv_within_bound"], figure=f"{max(r['kv_bytes_per_rank'])} <= {r['kv_bound_bytes']:.0f}"))
            if s == "ring_pass_kv":
                out.append(dict(target=f"exposed communication ring_pass_kv N={N} T={T} < 10% of TTFT",
                                met=r["comm_wait_frac"] < 0.10, figure=f"{r['comm_wait_frac'] * 100:.1f}%"))
        del at
    return out


def _ops(per_rank: list[dict]) -> str:
    """'ring_shift 1.2, all_gather 0.4': each operation's wait, the largest over ranks, in ms."""
    ops = sorted({op for d in per_rank for op in d})
    return ", ".join(f"{op} {max(d.get(op, 0.0) for d in per_rank) * 1e3:.1f}" for op in ops) or "-"


def _mib(x):
    return x / 2**20


def format_report(report) -> str:
    lines = ["# hf-contextpar benchmark", ""]
    for n_key, info in report["runs"].items():
        m = info["machine"]
        lines.append(f"- run N={n_key}: model {info['model']} ({info['dtype']}, {info['device']}), threads/rank "
                     f"{info['threads_per_rank']} of {info['cores']} cores, repeats {info['repeats']}, decode "
                     f"{info['new_tokens']} tokens; C_attn {m['attn_flops'] / 1e9:.2f} GFLOP/s, C_gemm "
                     f"{m['gemm_flops'] / 1e9:.2f} GFLOP/s, BW {m['bandwidth'] / 1e9:.3f} GB/s, small collective "
                     f"{info['small_collective_s'] * 1e3:.3f} ms ({info.get('small_collective_after_compute_s', 0) * 1e3:.3f} ms "
                     f"after compute) -> decode floor {info['decode_floor_s'] * 1e3:.2f} ms/token; "
                     f"load {', '.join(f'{x:.2f}' for x in info['load_before'])}")
        for s in info.get("skipped", []):
            lines.append(f"  - skipped {s['strategy']}: {s['reason']}")
    lines += ["", "| strategy | N | thr | T | TTFT ms | CPU ms | pred ms | speed-up 1p | CPU speed-up | vs all cores | comm wait | "
              "wait by op ms | TTIT ms | TTIT ratio | KV MiB/rank | peak MiB/rank | sent MiB/rank | recv MiB/rank | tokens = |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    for r in report["rows"]:
        name = r["strategy"] if r["kind"] == "cp" else f"*{r['strategy']}* (run N={r['run_N']})"
        pred = r.get("predicted_ttft_s")
        lines.append(
            f"| {name} | {r['N']} | {r['threads_per_rank']} | {r['length']} | {r['ttft_s'] * 1e3:.1f} | "
            f"{max(r['ttft_cpu_s_per_rank']) * 1e3:.0f} | "
            f"{f(pred and pred * 1e3, '.1f')} | {f(r.get('speedup_vs_unpatched'), '.2f')} | "
            f"{f(r.get('cpu_speedup_vs_unpatched'), '.2f')} | "
            f"{f(r.get('speedup_vs_unpatched_all_cores'), '.2f')} | {r['comm_wait_frac'] * 100:.1f}% | "
            f"{_ops(r['comm_wait_by_op_s_per_rank'])} | "
            f"{r['ttit_s'] * 1e3:.2f} | {f(r.get('ttit_ratio_vs_unpatched'), '.2f')} | "
            f"{_mib(max(r['kv_bytes_per_rank'])):.2f} | {_mib(max(r['peak_delta_bytes_per_rank'])):.0f} | "
            f"{_mib(max(r['bytes_sent_per_rank'])):.2f} | {_mib(max(r['bytes_received_per_rank'])):.2f} | "
            f"{f(r.get('tokens_match_unpatched'), '')} |")
    lines += ["", "TTFT: slowest rank, median of repeats; CPU: that rank's process CPU time (all its threads). "
              "speed-up 1p: unpatched one process with the run's threads "
              "per process / this TTFT; CPU speed-up: the same ratio of CPU times (blind to other processes' load); "
              "vs all cores: the TTFT ratio against the unpatched process on every core. comm wait: the slowest rank's time "
              "blocked in communication during prefill, share of TTFT. peak: RSS growth over the config (CPU) or "
              "CUDA peak. tokens =: greedy tokens identical to the unpatched run.", "", "## Targets", ""]
    for t in report.get("targets", []):
        lines.append(f"- {'met' if t['met'] else 'MISSED'}: {t['target']}: {t['figure']}")
    return "\n".join(lines) + "\n"


def plot(report, out_dir) -> list[str]:
    """ttft.png, speedup.png, kv_memory.png in out_dir; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(pred):
        groups = {}
        for r in report["rows"]:
            if pred(r):
                label = (f"{r['strategy']} N={r['N']}" if r["kind"] == "cp"
                         else f"{r['strategy']} ({r['threads_per_rank']} thr)")
                groups.setdefault(label, []).append(r)
        return {k: sorted(v, key=lambda r: r["length"]) for k, v in groups.items()}

    names = []
    for fname, ylabel, value, pred, logy in (
        ("ttft.png", "TTFT (s)", lambda r: r["ttft_s"], lambda r: True, True),
        ("speedup.png", "speed-up vs unpatched, same threads/process", lambda r: r.get("speedup_vs_unpatched"),
         lambda r: r.get("speedup_vs_unpatched") is not None and r["run_N"] > 1, False),
        ("kv_memory.png", "KV cache per rank (MiB, largest rank)", lambda r: _mib(max(r["kv_bytes_per_rank"])),
         lambda r: r["strategy"] != "unpatched_all_cores", True),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, rs in series(pred).items():
            style = "--" if rs[0]["kind"] == "baseline" else "-"
            (line,) = ax.plot([r["length"] for r in rs], [value(r) for r in rs], style, marker="o", label=label)
            x = [r["length"] for r in rs]
            if fname == "ttft.png" and all(r.get("predicted_ttft_s") for r in rs):
                ax.plot(x, [r["predicted_ttft_s"] for r in rs], "x", color=line.get_color(), alpha=0.6)
            if fname == "speedup.png" and rs[0]["kind"] == "cp":
                ax.plot(x, [r["cpu_speedup_vs_unpatched"] for r in rs], ":", color=line.get_color(), alpha=0.7)
        if fname == "speedup.png":
            ax.axhline(1.8, color="grey", lw=0.8, ls=":", label="target 1.8x")
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel("prompt tokens" + {"ttft.png": "   (x: cost-model prediction)",
                                          "speedup.png": "   (dotted: CPU-time speed-up)"}.get(fname, ""))
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, fname), dpi=110)
        plt.close(fig)
        names.append(fname)
    return names


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m hf_contextpar.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"hub id, local dir or tiny-<family> (default {DEFAULT_MODEL})")
    p.add_argument("--lengths", default="4096,8192,16384", help="prompt lengths, comma-separated")
    p.add_argument("--strategies", default=None, help="comma-separated (default: every strategy of this build but auto)")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens generated per config (TTIT over the last n-1)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: cores / N)")
    p.add_argument("--repeats", type=int, default=3, help="timed prefills per config (median)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--out", default="bench", help="output directory (bench.json, bench.md, *.png)")
    p.add_argument("--kvr-partitions", help="KV-Runahead partition table (JSON from `python -m hf_contextpar kvr-table`): "
                   f"adds a row '{KVR_TABLE}' next to kv_runahead's even partitions")
    p.add_argument("--no-all-cores", action="store_true", help="skip the all-cores unpatched baseline")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--cpu", action="store_true", help="stay on CPU even if CUDA is available")
    args = p.parse_args(argv)
    try:
        run(args)
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
