"""`python -m hf_contextpar selftest`: does context parallelism give the single-process answer on this machine?

    torchrun --nproc_per_node N -m hf_contextpar selftest [--model M] [--json report.json]
    python -m hf_contextpar selftest --simulated [--timing] [--json report.json]

Under torchrun (CUDA/NCCL when CUDA is available, else CPU/gloo): a compact exactness matrix of
the patched model on N ranks against the unpatched model on one process (`matrix`), then a short
benchmark (`benchmark`). With --simulated, on one process (one GPU hosts one NCCL rank): every
attention algorithm on simulated ranks, the fused kernels and the merge, against plain attention
(`single`), and with --timing the kernels and the merge at long lengths (`timing`).

Rank 0 prints a table, then one verdict line (`selftest: PASS 33/33 cases, N=2, cpu/gloo+shm, ...`);
--json writes the report. Exit status: 0 when every case passed, 1 otherwise (the failing cases
are listed), 2 when the self-test could not run.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time

import torch

DEFAULT_MODEL = "tiny-llama"
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def add_arguments(p):
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"hub id, local dir, or built-in needle-lm / tiny-<family> (default {DEFAULT_MODEL}: random, GQA)",
    )
    p.add_argument("--dtypes", default="fp32,bf16,fp16", help="comma-separated, of fp32, bf16, fp16")
    p.add_argument("--json", help="write the report here (rank 0)")
    p.add_argument("--cpu", action="store_true", help="stay on CPU even if CUDA is available")
    p.add_argument("--threads", type=int, default=0, help="torch threads per process (default: cores / N on CPU)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a rank waits for a peer within one case")
    p.add_argument("--bench-length", type=int, default=0, help="benchmark prompt length (default CPU 2048, CUDA 16384)")
    p.add_argument("--bench-repeats", type=int, default=3)
    p.add_argument("--no-bench", action="store_true", help="skip the benchmark")
    p.add_argument(
        "--inject-fault",
        metavar="GLOB",
        help="perturb, inside the checker only, the results of the cases whose names match (e.g. "
        "'float32/greedy/*'): proves the checker can fail; the library is untouched",
    )
    s = p.add_argument_group("single process (--simulated)")
    s.add_argument("--simulated", action="store_true", help="algorithms on simulated ranks, kernels, merge")
    s.add_argument("--timing", action="store_true", help="also time the kernels and the merge against SDPA")
    s.add_argument(
        "--timing-lengths",
        help="comma-separated token counts (default on CUDA 32768,65536,131072; required on CPU, e.g. 2048,4096)",
    )
    s.add_argument("--timing-world", type=int, default=4, help="head-tail ranks whose work is timed (default 4)")
    s.add_argument("--timing-shape", default="32,8,128", help="query heads, KV heads, head dim (default Llama-3-8B)")


def run(args):
    """Entry point of the subcommand; exits with the verdict's status."""
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPE_NAMES]
    if bad or not dtypes:
        raise SystemExit(f"--dtypes: {bad or dtypes} not among {list(DTYPE_NAMES)}")
    cuda = torch.cuda.is_available() and not args.cpu
    if args.simulated:
        if args.inject_fault:
            raise SystemExit("--inject-fault applies to the torchrun matrix, not to --simulated")
        sys.exit(_run_simulated(args, dtypes, cuda))
    sys.exit(_run_distributed(args, dtypes, cuda))


def _environment(device) -> dict:
    import transformers

    env = dict(torch=torch.__version__, transformers=transformers.__version__, python=platform.python_version())
    env["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return env


def _verdict(kind: str, records: list[dict], where: str, seconds: float) -> tuple[str, list[dict]]:
    failed = [r for r in records if r["status"] != "pass"]
    word = "PASS" if records and not failed else "FAIL"
    line = f"selftest{kind}: {word} {len(records) - len(failed)}/{len(records)} {where}, {seconds:.0f} s"
    return line, failed


def _write(path, report):
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


# -- single process -----------------------------------------------------------------------------
def _run_simulated(args, dtypes, cuda) -> int:
    from .single import run_checks

    t0 = time.perf_counter()
    device = torch.device("cuda" if cuda else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = _timing_lengths(args, device) if args.timing else None  # a bad request fails before the checks
    print(f"selftest --simulated on {device.type} ({_environment(device)['device']}), N = 2, 3, 4 simulated ranks")
    records = run_checks(device, dtypes)
    timing = _timing(args, device, lengths) if lengths else None
    line, failed = _verdict(
        " --simulated", records, f"checks, {device.type}, {','.join(dtypes)}, N=2,3,4", time.perf_counter() - t0
    )
    _print_failures(failed)
    print(line, flush=True)
    _write(
        args.json,
        dict(
            mode="simulated",
            verdict=line,
            passed=not failed,
            environment=_environment(device),
            checks=records,
            failed=[r["name"] for r in failed],
            timing=timing,
        ),
    )
    return 0 if not failed else 1


def _timing_lengths(args, device) -> list[int]:
    if args.timing_lengths:
        return [int(x) for x in args.timing_lengths.split(",")]
    if device.type == "cuda":
        return [32768, 65536, 131072]
    raise SystemExit("--timing on CPU: give --timing-lengths (e.g. 2048,4096); 32K-128K are meant for a GPU")


def _timing(args, device, lengths):
    from .timing import run_timing

    heads, kv_heads, head_dim = (int(x) for x in args.timing_shape.split(","))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return run_timing(device, lengths, args.timing_world, heads, kv_heads, head_dim, dtype)


def _print_failures(failed):
    for r in failed:
        print(f"  FAILED {r['name']}: {r['detail']}")


# -- torchrun -----------------------------------------------------------------------------------
def _run_distributed(args, dtypes, cuda) -> int:
    import torch.distributed as dist

    from ...comm.group import DEFAULT_TIMEOUT_S, release_at_exit, resolve_group
    from ...comm.shm import open_shm_gather
    from ..bench.measure import usable_cores
    from .benchmark import run_benchmark
    from .matrix import run_matrix

    t0 = time.perf_counter()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu")
    # the default group outlives a case's own group (--timeout) by enough for a stuck peer to time out
    group, rank, world = resolve_group(device=device, timeout=4 * args.timeout + 60)
    if group is None:
        print(
            "selftest: one process. Launch it with torchrun --nproc_per_node N (N >= 2), or run "
            "`python -m hf_contextpar selftest --simulated` for the single-process check.",
            file=sys.stderr,
        )
        return 2
    if not cuda:
        torch.set_num_threads(args.threads or max(1, usable_cores() // world))
    elif args.threads:
        torch.set_num_threads(args.threads)
    log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    backend = dist.get_backend()
    shm = open_shm_gather(dist.group.WORLD, rank, world, device, DEFAULT_TIMEOUT_S)  # what apply will find
    transport = backend + ("+shm" if shm is not None else "")  # decode's all-gathers through shared memory
    if shm is not None:
        shm.close()
    where = f"N={world}, {device.type}/{transport}"
    log(f"selftest: model {args.model}, {where}, {torch.get_num_threads()} threads/process")
    names = [DTYPE_NAMES[d] for d in dtypes]
    try:
        records, tolerances, in_step = run_matrix(
            args.model, names, rank, world, device, args.timeout, args.inject_fault, log
        )
        log(_table(records, names))
        bench = None
        if in_step and not args.no_bench:
            length = args.bench_length or (16384 if cuda else 2048)
            dtype = torch.bfloat16 if cuda else torch.float32
            try:
                bench = run_benchmark(
                    args.model, dtype, device, rank, world, length=length, new_tokens=8, repeats=args.bench_repeats
                )
                if rank == 0:
                    log(_bench_line(bench, world))
            except (Exception, SystemExit) as e:  # noqa: BLE001 - informative only: not part of the verdict
                bench = dict(error=f"{type(e).__name__}: {e}")
                print(f"rank {rank}: benchmark failed: {bench['error']}", file=sys.stderr)
        line, failed = _verdict(
            "", records, f"cases, {where}, {args.model}, {','.join(dtypes)}", time.perf_counter() - t0
        )
        if rank == 0:
            _print_failures(failed)
            print(line, flush=True)
            _write(
                args.json,
                dict(
                    mode="torchrun",
                    verdict=line,
                    passed=not failed,
                    world=world,
                    device=device.type,
                    backend=backend,
                    transport=transport,
                    model=args.model,
                    environment=_environment(device),
                    tolerances=tolerances,
                    cases=records,
                    failed=[r["name"] for r in failed],
                    benchmark=bench,
                    inject_fault=args.inject_fault,
                ),
            )
        status = 0 if not failed else 2 if all(r["status"] == "not_run" for r in records) else 1
    except SystemExit as e:
        print(f"rank {rank}: {e}", file=sys.stderr)
        status = 2
    try:
        dist.barrier()  # nobody tears the group down while a peer still uses it
        release_at_exit()
    except (RuntimeError, dist.DistError) as e:
        print(f"rank {rank}: final barrier failed ({e}); exiting without tearing down", file=sys.stderr)
    return status


def _table(records, dtypes) -> str:
    """Cases as rows, dtypes as columns: status and max |logit diff|."""
    rows = {}
    for r in records:
        which = r["decode"] if r["kind"] == "padded" else r["strategy"]
        label = f"{r['kind']} {'decode=' if r['kind'] == 'padded' else ''}{which}"
        if r["status"] == "pass":
            tie = "near-tie" in r["detail"]  # tokens compared up to a near-tie (see matrix.compare)
            cell = "refused (ok)" if r.get("refused") else f"ok{'*' if tie else ''} {r['max_diff']:.1e}"
        else:
            cell = r["status"].upper()
        rows.setdefault(label, {})[r["dtype"]] = cell
    width = max(len(k) for k in rows) + 2
    lines = [f"  {'case':<{width}}" + "".join(f"{d:>15}" for d in dtypes)]
    for label, cells in rows.items():
        lines.append(f"  {label:<{width}}" + "".join(f"{cells.get(d, '-'):>15}" for d in dtypes))
    if any("near-tie" in r["detail"] for r in records):
        lines.append(
            "  * tokens identical up to a near-tie (reference top-2 margin <= 2 x tolerance), compared up to it"
        )
    return "\n".join(lines)


def _bench_line(b, world) -> str:
    return (
        f"  benchmark ({b['dtype']}, {b['length']} tokens, strategy {b['strategy']}): "
        f"TTFT {b['cp']['ttft_s'] * 1e3:.1f} ms on N={world} vs {b['one_process']['ttft_s'] * 1e3:.1f} ms on one "
        f"process ({b['ttft_speedup']:.2f}x); TTIT {b['cp']['ttit_s'] * 1e3:.2f} ms vs "
        f"{b['one_process']['ttit_s'] * 1e3:.2f} ms; tokens identical: {b['tokens_identical']}"
    )
