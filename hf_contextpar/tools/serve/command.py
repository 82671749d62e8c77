"""`python -m hf_contextpar serve`: the model loaded and patched on every rank, rank 0 listening, every rank
running the lockstep loop (lockstep.py) until rank 0 says stop.

    torchrun --nproc_per_node 2 -m hf_contextpar serve                      # needle-lm on 127.0.0.1:8000
    torchrun --nproc_per_node 4 -m hf_contextpar serve Qwen/Qwen2.5-7B-Instruct --port 8080 --api-key KEY

Rank 0 runs uvicorn on a thread of its own and the loop on its main thread, as every other rank does: every
collective of the model runs on each rank's main thread, and a signal reaches the loop. SIGINT / SIGTERM to
rank 0 (torchrun forwards the launcher's): no new request is taken, what was taken is answered, every rank is
told to stop and exits 0. The other ranks ignore those signals and wait for rank 0's word, or for the timeout if
rank 0 is gone (then they exit non-zero, as every rank does when a peer dies: never a hang).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from ...api import DECODES, STRATEGIES
from ...cliargs import add_csa_arguments, csa_setting, nonnegative_int, positive_int
from ...models import DEFAULT_MODEL, LOAD_DTYPES, load, load_dtype

DEFAULT_TIMEOUT_S = 60.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model", nargs="?", default=None, help=f"hub id, local dir or built-in model (default {DEFAULT_MODEL})"
    )
    p.add_argument("--model", dest="model_option", default=None, help="the same as MODEL")
    p.add_argument("--served-name", help="the model's name in the API (default: MODEL as given)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=nonnegative_int, default=8000, help="port (default 8000; 0: any free port)")
    p.add_argument("--dtype", choices=LOAD_DTYPES, default="auto", help="default: the checkpoint's own (auto)")
    p.add_argument("--strategy", default="auto", choices=STRATEGIES, help="prefill algorithm (default: the planner)")
    p.add_argument("--decode", default="auto", choices=DECODES, help="decode algorithm")
    add_csa_arguments(p)
    p.add_argument("--tp", type=positive_int, default=1, help="tensor parallelism inside groups of this many ranks")
    p.add_argument(
        "--kv-budget",
        type=_bytes,
        help="KV bytes per rank kept for conversations (default: a quarter of "
        "free memory), e.g. 4GiB; the least recently used conversation goes first",
    )
    p.add_argument("--max-queue", type=positive_int, default=64, help="requests waiting at most; past it, 503")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $HF_CONTEXTPAR_API_KEY, if set)")
    p.add_argument("--max-body", type=_bytes, default=64 * 2**20, help="largest request body (default 64MiB)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds a rank waits for a peer")
    p.add_argument("--threads", type=nonnegative_int, default=0, help="torch threads per process (default: torch's)")
    p.add_argument("--cpu", action="store_true", help="stay on CPU even if CUDA is available")


def _bytes(text: str) -> int:
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    low = text.strip().lower()
    for unit, scale in units.items():
        if low.endswith(unit) and low[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(low[: -len(unit)]) * scale)
    if low.isdigit():
        return int(low)
    raise argparse.ArgumentTypeError(f"{text!r} is not a size: say e.g. 4GiB, 512MiB or a number of bytes")


def _default_budget(device: torch.device) -> int:
    """A quarter of the memory free now, shared by this host's ranks (CPU) or this rank's GPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] // 4
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return free // 4 // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _load(args, device):
    import hf_contextpar

    name = args.model_option or args.model or DEFAULT_MODEL
    dtype = load_dtype(args.dtype)
    cp_group = None
    if args.tp > 1:
        from ..tpload import load_tp

        model, tok, cp_group, _ = load_tp(name, args.tp, dtype, device)
    else:
        model, tok = load(name, dtype, device)
    hf_contextpar.apply_context_parallel(
        model,
        strategy=args.strategy,
        decode=args.decode,
        timeout=args.timeout,
        sparse=csa_setting(args),
        **(dict(group=cp_group) if cp_group is not None else {}),
    )
    return name, model, tok


def run(args) -> None:
    from .lockstep import Lockstep

    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    name, model, tok = _load(args, device)
    _one_replica(model, args.tp)
    rank = dist.get_rank() if dist.is_initialized() else 0
    budget = args.kv_budget or _default_budget(device)
    lockstep = Lockstep(model, tok, budget=budget, max_queue=args.max_queue, timeout=args.timeout)
    lockstep.measure()
    server = _start_http(args, args.served_name or name, model, tok, lockstep) if rank == 0 else None
    _route_signals(lockstep, server, rank)
    try:
        lockstep.run_forever()
    except BaseException:
        if server is not None:  # a few seconds for clients to see the failure (5xx, /health 503), then exit non-zero
            time.sleep(min(5.0, args.timeout))
        raise
    finally:
        if server is not None:
            server.should_exit = True
    if dist.is_initialized():
        dist.barrier(group=lockstep.group)
        dist.destroy_process_group()
    if rank == 0:
        print("stopped: every rank left in step", flush=True)


def _one_replica(model, tp: int) -> None:
    """The server is one CP group (x TP) of every process: rank 0 listens for all. Replicas (accelerate's
    PARALLELISM_CONFIG_DP_*_SIZE) would each run every request again; run one server per replica instead."""
    from ...api import get_runtime

    runtime = get_runtime(model)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if (runtime.world if runtime is not None else 1) * tp != world:
        raise SystemExit(
            f"error: serve runs one context-parallel group over all {world} processes; accelerate's parallelism "
            "config splits them into replicas (unset PARALLELISM_CONFIG_DP_REPLICATE_SIZE / _DP_SHARD_SIZE, or "
            "start one server per replica)."
        )


def _start_http(args, name: str, model, tok, lockstep):
    """uvicorn on its own thread, serving transformers' app over the lockstep loop; returns once it listens."""
    import uvicorn

    from .app import make_app

    app = make_app(model, tok, name, lockstep, api_key=args.api_key, max_body=args.max_body)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # the main thread's handlers are ours (_route_signals)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), name="hf-contextpar-http", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise SystemExit(f"error: could not listen on {args.host}:{args.port} (see the message above)")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    world = dist.get_world_size() if dist.is_initialized() else 1
    print(f"serving {name} on http://{args.host}:{port}/v1 ({world} process(es))", flush=True)
    return server


def _route_signals(lockstep, server, rank: int) -> None:
    """Rank 0: SIGINT / SIGTERM stop taking requests and end the loop after what was taken. The others ignore them:
    rank 0 tells them when to stop (a rank leaving on its own would leave rank 0 inside a collective)."""

    def stop(signum, frame):
        lockstep.stop()
        if server is not None:
            server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop if rank == 0 else signal.SIG_IGN)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m hf_contextpar serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p)
    run(p.parse_args(sys.argv[1:] if argv is None else argv))
