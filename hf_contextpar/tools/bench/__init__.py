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
(`costmodel`), printed next to the measurement. PyTorch's own ring attention
(`torch.distributed.tensor.experimental`, allgather and alltoall rotation) runs as peer rows in the
same rounds: prefill only, its logits checked against the unpatched model, ring_pass_kv / peer TTFT.
Rows for other world sizes already in DIR/bench.json are kept, so an N=1 and an N=2 run fill one
table and one set of plots. `--csa KEEP|FILE [--topology AxB]` adds the APPROXIMATE mode (CSPS's CSA,
docs/csa.md) as rows of their own ('csa', never a target) in the same rounds, beside exact ring pass-KV
(run too): each rank's TTFT and bytes sent, side by side, and its greedy tokens against the unpatched model.

    python -m hf_contextpar.bench --report bench/bench.json     # the markdown report again, no run

(docs/benchmarks.md is made from docs/bench.json by a checkout's `python -m dev.benchmarks_page`.)
"""

from __future__ import annotations

import argparse
import importlib.util

import torch.distributed as dist

from ...cliargs import add_csa_arguments, csa_setting, nonnegative_int, positive_int, positive_ints, writable_dir
from ...models import DTYPES
from .report import PLOTS_EXTRA, report_markdown
from .run import DEFAULT_MODEL, KVR_TABLE, run


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m hf_contextpar.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"hub id, local dir or tiny-<family> (default {DEFAULT_MODEL})"
    )
    p.add_argument("--lengths", type=positive_ints, default="4096,8192,16384", help="prompt lengths, comma-separated")
    p.add_argument(
        "--strategies", default=None, help="comma-separated (default: every strategy of this build but auto)"
    )
    p.add_argument(
        "--new-tokens", type=positive_int, default=16, help="tokens generated per config (TTIT over the last n-1)"
    )
    p.add_argument("--threads", type=nonnegative_int, default=0, help="torch threads per rank (default: cores / N)")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed prefills per config (median)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument(
        "--out", type=writable_dir, default=None, help="output directory (bench.json, bench.md, *.png; default bench)"
    )
    p.add_argument(
        "--kvr-partitions",
        help="KV-Runahead partition table (JSON from `python -m hf_contextpar kvr-table`), 'balanced' (equal "
        f"work per rank, as measured) or 'even': adds a row '{KVR_TABLE}' next to kv_runahead's default partitions",
    )
    p.add_argument(
        "--peers",
        default=None,
        help="peer rows: PyTorch's ring attention, prefill only, logits checked against the unpatched model "
        "(default: torch_ring_allgather,torch_ring_alltoall where this torch has them; 'none' to skip)",
    )
    p.add_argument("--no-all-cores", action="store_true", help="skip the all-cores unpatched baseline")
    p.add_argument(
        "--gloo-rows",
        action="store_true",
        help="also run every strategy with shared memory off (rows '<strategy>+gloo'), in the same rounds",
    )
    add_csa_arguments(p)  # rows of their own beside ring_pass_kv's: the approximate mode, never a strategy
    p.add_argument("--no-plots", action="store_true", help="write no PNGs (needs no matplotlib)")
    p.add_argument("--cpu", action="store_true", help="stay on CPU even if CUDA is available")
    p.add_argument(
        "--report",
        metavar="JSON",
        help="print the markdown report of an existing bench.json and exit (no run; every other option is ignored)",
    )
    args = p.parse_args(argv)
    if args.report is not None:
        try:
            print(report_markdown(args.report), end="")
        except (OSError, ValueError) as e:
            p.error(str(e))
        return
    args.sparse = csa_setting(args)  # a bad --csa / --topology ends here, before a model loads
    if args.out is None:  # made here, not as the default, so that --report makes no folder
        try:
            args.out = writable_dir("bench")
        except argparse.ArgumentTypeError as e:
            p.error(str(e))
    if not args.no_plots and importlib.util.find_spec("matplotlib") is None:  # say so before the long run
        p.error(f"the plots need matplotlib: {PLOTS_EXTRA} (or pass --no-plots)")
    try:
        run(args)
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
