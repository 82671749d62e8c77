"""`python -m hf_contextpar.eval needlebench|bookcorpus|csa`: is the context-parallel model the same model
(csa: what the approximate mode costs)?

    torchrun --nproc_per_node 2 -m hf_contextpar.eval needlebench --model tiny-llama --lengths 512,1024 --out nb/
    torchrun --nproc_per_node 4 -m hf_contextpar.eval needlebench --model meta-llama/Llama-3.1-8B-Instruct \\
        --dtype bfloat16 --lengths 4096,16384 --depths 0,25,50,75,100 --out nb/
    torchrun --nproc_per_node 2 -m hf_contextpar.eval bookcorpus --model ... --window 8192 --num-windows 4 --out bc/
    accelerate launch --multi_gpu --num_processes 4 -m hf_contextpar.eval needlebench ...

Writes OUT/report.json, OUT/report.md and PNG plots (rank 0), prints a summary, and exits
0 when every case is equivalent, 1 when any is not, 2 when it could not run.
"""

from __future__ import annotations

import argparse
import os
import sys

import hf_contextpar
from hf_contextpar.cliargs import nonnegative_int, positive_int
from hf_contextpar.models import DEFAULT_MODEL, DTYPES

from . import bookcorpus as bc
from . import needlebench as nb
from .bookcorpus_cmd import cmd_bookcorpus
from .common import EXIT_ERROR, EXIT_NOT_EQUIVALENT, drop_reports
from .csa_cmd import add_arguments as csa_arguments
from .csa_cmd import cmd_csa
from .csa_config import add_arguments as csa_config_arguments
from .csa_config import cmd_csa_config
from .needlebench_cmd import cmd_needlebench
from .oracle import describe_tolerances

__all__ = ["EXIT_ERROR", "EXIT_NOT_EQUIVALENT", "main"]


# -- arguments ---------------------------------------------------------------------------------
def _common(p):
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"hub id, local dir, or built-in needle-lm / tiny-<family> (default {DEFAULT_MODEL})",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument(
        "--strategy", choices=hf_contextpar.api.STRATEGIES, default="auto", help="prefill algorithm (default auto)"
    )
    p.add_argument("--out", required=False, default="eval_out", help="report directory (default eval_out)")
    p.add_argument(
        "--source",
        choices=("auto", "hub", "builtin"),
        default="auto",
        help="data: hub (or its cache, or --data), builtin (offline text shipped with Python and "
        "hf-contextpar), or auto: builtin for the built-in models (needle-lm, tiny-*), else hub with a fall-back to builtin",
    )
    p.add_argument("--data", help="a local copy of the dataset (directory or files) instead of the hub")
    p.add_argument(
        "--reference", metavar="FILE", help="compare against a saved single-process run instead of computing it"
    )
    p.add_argument(
        "--save-reference", metavar="FILE", help="run the unpatched model on one process and save its outputs"
    )
    p.add_argument("--tolerance", type=float, help="max |logit diff| allowed (default: by dtype, see --help epilog)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=nonnegative_int, default=0, help="torch threads per process (default: torch's)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds a rank waits for its peers (default 1800)")
    p.add_argument("--cpu", action="store_true", help="stay on CPU even if CUDA is available")
    p.add_argument(
        "--cp-size",
        type=positive_int,
        help="processes per CP group: the launch splits into replicas that share the cases (needlebench, "
        "bookcorpus; default: one group of all, or accelerate's PARALLELISM_CONFIG_CP_SIZE)",
    )


TOLERANCE_HELP = (
    "tolerance on max |logit diff| (context-parallel vs one process): "
    f"{describe_tolerances(' on the first prompt')}. Generated tokens must be identical."
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m hf_contextpar.eval",
        description=__doc__,
        epilog=TOLERANCE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    n = sub.add_parser(
        "needlebench", help="needle-in-a-haystack generation, length x depth grid", epilog=TOLERANCE_HELP
    )
    _common(n)
    n.add_argument("--lengths", default="4096,16384", help="prompt lengths in the model's tokens (default 4096,16384)")
    n.add_argument("--depths", default="0,25,50,75,100", help="needle depths in %% of the haystack")
    n.add_argument("--tasks", default=",".join(nb.TASKS), help=f"comma-separated subset of {', '.join(nb.TASKS)}")
    n.add_argument("--max-new-tokens", type=positive_int, default=32)
    n.add_argument(
        "--needles",
        help="single_retrieval over these needles ('all' or indices, e.g. 0,2): one prompt per needle in every "
        "cell, scores averaged per cell (default: one needle chosen by --seed, as NeedleBench does)",
    )
    n.add_argument("--num-needles", type=positive_int, default=3, help="needles in multi_retrieval (default 3)")
    n.add_argument("--reasoning-needles", type=positive_int, default=2, help="facts in multi_reasoning (default 2)")
    n.add_argument(
        "--spacing", type=int, default=10, help="%% of the haystack between consecutive needles (default 10)"
    )
    n.add_argument(
        "--allow-near-ties",
        action="store_true",
        help="accept a token divergence at a step where the reference's top choice beat the context-parallel "
        "one by at most twice the tolerance (low precision: a kernel swap flips such ties too); "
        "default: generated tokens must be identical",
    )
    n.add_argument(
        "--no-chat-template",
        action="store_true",
        help="prompt with plain text even if the tokenizer has a chat template",
    )
    n.set_defaults(func=cmd_needlebench)
    b = sub.add_parser("bookcorpus", help="teacher-forced windows: full logits, NLL, perplexity", epilog=TOLERANCE_HELP)
    _common(b)
    b.add_argument("--window", type=positive_int, default=8192, help="tokens per window (default 8192)")
    b.add_argument("--num-windows", type=positive_int, default=4)
    b.add_argument("--dataset-id", default=bc.HUB_ID, help=f"hub dataset with a text column (default {bc.HUB_ID})")
    b.add_argument(
        "--revision",
        default=bc.HUB_REVISION,
        help=f"its revision (default {bc.HUB_REVISION}, the hub's parquet conversion)",
    )
    b.add_argument("--text-column", default="text")
    b.set_defaults(func=cmd_bookcorpus)
    c = sub.add_parser(
        "csa", help="the approximate mode (CSA) beside the exact run and one process: scores, bytes, TTFT"
    )
    _common(c)
    csa_arguments(c)
    c.set_defaults(func=cmd_csa)
    g = sub.add_parser("csa-config", help="CSA's keep fractions from a calibration split, within an accuracy drop")
    _common(g)
    csa_config_arguments(g)
    g.set_defaults(func=cmd_csa_config)
    args = p.parse_args(argv)
    if not args.save_reference and os.environ.get("RANK", "0") == "0":
        drop_reports(args.out)  # before anything can fail: OUT/report.json must not outlive a run that did
    try:
        return args.func(args)
    except SystemExit as e:
        if isinstance(e.code, str):
            if os.environ.get("RANK", "0") == "0":  # every rank reaches the same error; say it once
                print(f"error: {e.code}", file=sys.stderr)
            return EXIT_ERROR
        raise
    except Exception:  # a crash is not a verdict: exit 2, so a gate can tell "could not run" from "not equivalent"
        import traceback

        traceback.print_exc()
        return EXIT_ERROR
