"""One benchmark run: the configurations, interleaved round-robin, on N ranks (or one)."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from ...comm.group import DEFAULT_TIMEOUT_S, resolve_group
from ...comm.shm import open_shm_gather
from ...model.shape import model_shape
from ...models import DTYPES, load
from ..calibrate import measure, small_collective_s
from .measure import PeerSamples, Samples, small_collective_after_compute_s, usable_cores
from .report import format_report, plot
from .rows import GLOO, annotate, make_row, merge
from .torch_ring import PEERS, TorchRing

DEFAULT_MODEL = "needle-lm"
BASELINES = ("unpatched", "unpatched_all_cores")
KVR_TABLE = "kv_runahead_table"  # a row of its own: KV-Runahead with --kvr-partitions, next to its default (balanced)
CSA_ROW = "csa"  # --csa: the approximate mode's row (kind "csa"), beside ring_pass_kv
PEER_TOLERANCE = {torch.float64: 1e-4, torch.float32: 1e-4}  # PyTorch's ring merges in fp32 (convert_to_f32)
PEER_TOLERANCE_HALF = 1e-2


def _strategies(requested: str | None) -> list[str]:
    from ...api import STRATEGIES

    if not requested:
        return [s for s in STRATEGIES if s != "auto"]
    names = [s.strip() for s in requested.split(",") if s.strip()]
    bad = [s for s in names if s not in STRATEGIES]
    if bad:
        raise SystemExit(f"unknown strategies {bad}; this build has {list(STRATEGIES)}")
    return names


def _configs(args, world) -> list[str]:
    """The patched configurations of one run: the strategies, KV-Runahead with --kvr-partitions, the '+gloo'
    rows, and with --csa the approximate row (CSA_ROW), which needs ring_pass_kv beside it (its rival)."""
    strategies = _strategies(args.strategies)
    if getattr(args, "sparse", None) is not None and "ring_pass_kv" not in strategies:
        strategies.insert(0, "ring_pass_kv")
    if args.kvr_partitions and "kv_runahead" in strategies:
        strategies.append(KVR_TABLE)
    if args.gloo_rows and world > 1:  # the same strategies with decode's gathers over gloo (shared memory off)
        strategies += [s + GLOO for s in strategies]
    if getattr(args, "sparse", None) is not None:
        strategies.append(CSA_ROW)
    return strategies


def _gather(obj, world):
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _peers(requested: str | None, world: int, model) -> tuple[list[str], list[dict]]:
    """The peer rows to run (PyTorch's ring, one per rotate method) and the notes of those skipped."""
    from hf_contextpar.patches import REGISTRY

    from .torch_ring import unavailable

    names = list(PEERS) if requested is None else [s.strip() for s in requested.split(",") if s.strip() != "none"]
    bad = [s for s in names if s not in PEERS]
    if bad:
        raise SystemExit(f"unknown peers {bad}; known: {list(PEERS)} (or none)")
    reason = unavailable() if names else None
    family = REGISTRY.get(model.config.model_type)
    if names and family is not None and family.recurrent:  # it would run each rank's recurrent layers from zero
        reason = "PyTorch's ring attention shards attention alone; this model's recurrent layers need the state chain"
    if reason:
        return [], [dict(strategy=s, N=world, reason=reason) for s in names]
    return names, []


def run(args) -> dict | None:
    import hf_contextpar

    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu")
    _, rank, world = resolve_group(device=device)  # the library's one process-group start-up
    cores = usable_cores()
    threads = args.threads or max(1, cores // world)
    torch.set_num_threads(threads)
    barrier = dist.barrier if world > 1 else None
    dtype = DTYPES[args.dtype]
    model, _ = load(args.model, dtype, device)
    shape = model_shape(model)
    lengths = sorted(args.lengths)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(
        0, min(256, model.config.get_text_config(decoder=True).vocab_size), (1, max(lengths)), generator=g
    ).to(device)
    strategies = _configs(args, world)
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if rank == 0 else (lambda *a: None)
    log(
        f"bench: model {args.model}  N={world}  threads/rank {threads}  cores {cores}  lengths {lengths}  "
        f"strategies {strategies}"
    )

    machine = measure(shape, dtype, device)
    # decode's floor: one small all-gather per layer, over the transport decode uses (see _transport)
    transport, floors = _transport(device, rank, world)
    numel = shape.heads * (shape.head_dim + 1)
    floor = {t: small_collective_s(numel, gather=g) for t, g in floors.items()}
    woken = {t: small_collective_after_compute_s(numel, gather=g) for t, g in floors.items()}
    floor_collective, woken_collective = floor.get(transport, 0.0), woken.get(transport, 0.0)
    log(
        f"machine: C_attn {machine.attn_flops / 1e9:.2f} GFLOP/s  C_gemm {machine.gemm_flops / 1e9:.2f} GFLOP/s  "
        f"BW {machine.bandwidth / 1e9:.3f} GB/s  small collective "
        + "  ".join(f"{t} {floor[t] * 1e3:.3f} ms ({woken[t] * 1e3:.3f} ms after compute)" for t in floor)
        + (f"  decode uses {transport}" if transport else "")
    )

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
        extra, gloo = {}, strategy.endswith(GLOO)
        strategy = strategy.removesuffix(GLOO)
        if strategy == KVR_TABLE:  # KV-Runahead with the table's interpolated partitions (KVR-P)
            strategy, extra = "kv_runahead", dict(partitions=args.kvr_partitions)
        if strategy == CSA_ROW:  # fresh prefills run CSA; anything over a cache runs ring pass-KV, exact
            strategy, extra = "ring_pass_kv", dict(sparse=args.sparse)
        hf_contextpar.apply_context_parallel(model, strategy=strategy, **extra)
        try:
            runtime = hf_contextpar.get_runtime(model)
            if gloo and runtime is not None:
                runtime.comm.close_shm()  # every rank alike: this row's gathers go over gloo
            fn(runtime.comm.stats if runtime is not None else None)
        finally:
            hf_contextpar.remove_context_parallel(model)

    # Warm-up every configuration once (allocator, process-group connections) and drop the strategies
    # this model cannot run.
    for _, n_threads in baselines:
        baseline(n_threads, lambda: Samples().measure(model, warm, last=True, new_tokens=2, device=device))
    active = []
    for strategy in strategies:
        try:
            patched(
                strategy,
                lambda st: Samples().measure(
                    model, warm, last=True, new_tokens=2, stats=st, barrier=barrier, device=device
                ),
            )
            active.append(strategy)
        except (ValueError, NotImplementedError, hf_contextpar.ContextParallelError) as e:
            skipped.append(dict(strategy=strategy, N=world, reason=f"{type(e).__name__}: {e}"))
            log(f"  {strategy}: skipped ({type(e).__name__}: {e})")
            if barrier:
                barrier()

    # PyTorch's ring attention as peer rows (prefill only), warmed up like the strategies.
    peer_names, peer_skips = _peers(args.peers, world, model)
    for s in peer_skips:
        skipped.append(s)
        log(f"  {s['strategy']}: skipped ({s['reason']})")
    peers = {}
    for name in peer_names:
        try:
            peer = TorchRing(model, PEERS[name], device)  # imports torch's CP module: only where available
            PeerSamples().measure(peer, warm[:, : warm.shape[1] // (2 * world) * 2 * world], last=True, device=device)
            peers[name] = peer
        except (ValueError, NotImplementedError, RuntimeError) as e:
            skipped.append(dict(strategy=name, N=world, reason=f"{type(e).__name__}: {e}"))
            log(f"  {name}: skipped ({type(e).__name__}: {e})")
            if barrier:
                barrier()
    peer_diffs = {}  # (peer, length) -> max |logit diff| against the unpatched model

    # Side by side: every configuration once per round, so slow drifts in machine load hit all of them alike.
    for length in lengths:
        x = ids[:, :length]
        samples = {c: Samples() for c in [b[0] for b in baselines] + active}
        length_peers = [p for p in peers if length % (2 * world) == 0]
        for name in set(peers) - set(length_peers):
            skipped.append(
                dict(strategy=name, N=world, reason=f"T={length}: PyTorch's load balancer needs a multiple of 2N")
            )
        peer_diffs.update(_check_peers({p: peers[p] for p in length_peers}, model, x, rank, barrier, log))
        samples.update({p: PeerSamples() for p in length_peers})
        for rep in range(args.repeats):
            last = rep == args.repeats - 1
            for kind, n_threads in baselines:
                baseline(
                    n_threads,
                    lambda: samples[kind].measure(model, x, last=last, new_tokens=args.new_tokens, device=device),
                )
            for strategy in active:
                patched(
                    strategy,
                    lambda st: samples[strategy].measure(
                        model, x, last=last, new_tokens=args.new_tokens, stats=st, barrier=barrier, device=device
                    ),
                )
            for name in length_peers:
                samples[name].measure(peers[name], x, last=last, barrier=barrier, device=device)
        for kind, n_threads in baselines:
            if rank == 0:
                rows.append(make_row("baseline", kind, 1, length, n_threads, [samples[kind].summary()]))
        for strategy in active:
            kind = "csa" if strategy == CSA_ROW else "cp"  # approximate: a row of its own kind, never a target
            rows.append(make_row(kind, strategy, world, length, threads, _gather(samples[strategy].summary(), world)))
        for name in length_peers:
            row = make_row("peer", name, world, length, threads, _gather(samples[name].summary(), world))
            row["logits_max_abs_diff"] = peer_diffs[name, length]
            row["logits_tolerance"] = _peer_tolerance(dtype)
            row["logits_ok"] = peer_diffs[name, length] <= row["logits_tolerance"]
            rows.append(row)
        for r in rows:
            if r["length"] == length:
                ttit = "-" if r["ttit_s"] is None else f"{r['ttit_s'] * 1e3:7.2f}"
                log(
                    f"  {r['strategy']:22s} N={r['N']} threads {r['threads_per_rank']}  T={length:6d}  "
                    f"TTFT {r['ttft_s'] * 1e3:9.1f} ms  TTIT {ttit:>7s} ms  comm wait "
                    f"{r['comm_wait_frac'] * 100:5.1f}%"
                )

    failed = sorted({p for (p, _), d in peer_diffs.items() if not d <= _peer_tolerance(dtype)})
    if rank != 0:
        if failed:
            raise SystemExit(f"PyTorch ring peer rows {failed} computed wrong logits (see rank 0)")
        return None
    run_info = dict(
        N=world,
        threads_per_rank=threads,
        cores=cores,
        model=args.model,
        dtype=args.dtype,
        device=str(device),
        repeats=args.repeats,
        new_tokens=args.new_tokens,
        lengths=lengths,
        machine=machine.as_dict(),
        transport=transport,
        small_collective_s=floor_collective,
        decode_floor_s=shape.layers * floor_collective,
        small_collective_after_compute_s=woken_collective,
        small_collective_by_transport=floor,
        small_collective_after_compute_by_transport=woken,
        shape=shape.__dict__,
        load_before=os.getloadavg(),
        torch=torch.__version__,
        skipped=skipped,
        partitions=args.kvr_partitions,
        windowed=_windowed(model.config),
        csa=args.sparse.resolved(world).describe() if getattr(args, "sparse", None) is not None else None,
    )
    annotate(rows, run_info, shape, machine)
    report = merge(os.path.join(args.out, "bench.json"), run_info, rows)
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
    if failed:
        raise SystemExit(
            f"PyTorch ring peer rows {failed} computed logits beyond tolerance {_peer_tolerance(dtype):g} of the "
            "unpatched model: their timings measure a wrong computation (report written, marked FAILED)"
        )
    return report


def _transport(device, rank, world):
    """(what decode's all-gathers use, {transport: gather(out, t) to time}): "shm" where
    apply_context_parallel would open a shared-memory gather (CPU ranks on one host), else the
    process group's own; both are timed where shm is available, for the floor of each."""
    if world == 1:
        return None, {}
    gloo = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    shm = open_shm_gather(dist.group.WORLD, rank, world, device, DEFAULT_TIMEOUT_S)
    name = "gloo" if device.type == "cpu" else "nccl"
    if shm is None:
        return name, {name: gloo}
    return "shm", {"shm": shm.gather_into, name: gloo}


def _peer_tolerance(dtype) -> float:
    return PEER_TOLERANCE.get(dtype, PEER_TOLERANCE_HALF)


@torch.no_grad()
def _check_peers(peers: dict, model, x, rank, barrier, log) -> dict:
    """Every peer's logits (all positions, `context_parallel_unshard`) against the unpatched model on
    rank 0; {(peer, length): max |diff|}, the same on every rank. Not timed."""
    if not peers:
        return {}
    ref = model(input_ids=x, use_cache=False).logits if rank == 0 else None
    if barrier:
        barrier()
    out = {}
    for name, peer in peers.items():
        got = peer.logits(x)
        diff = torch.tensor([(got - ref).abs().max().item() if rank == 0 else 0.0], dtype=torch.float64)
        if barrier:
            dist.broadcast(diff, src=0)
        out[name, x.shape[1]] = diff.item()
        log(f"  {name:22s} T={x.shape[1]:6d}  max |logit diff| vs unpatched {diff.item():.2e}")
        del got
    return out


def _windowed(config) -> bool:
    """Whether any layer attends through a sliding window (their masks are where O(T^2) buffers hide)."""
    text = config.get_text_config(decoder=True)
    if "sliding_attention" in (getattr(text, "layer_types", None) or []):
        return True
    return bool(getattr(text, "sliding_window", None)) and getattr(text, "use_sliding_window", True)
