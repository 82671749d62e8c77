"""Gate a deployment on exactness: NeedleBench, then BookCorpus, each on N processes.

    python examples/eval_gate.py                                   # built-in needle-lm, offline, 2 processes
    python examples/eval_gate.py --nproc 4 --model meta-llama/Llama-3.1-8B-Instruct --dtype bfloat16 \\
        --lengths 4096,16384 --window 8192 --out gate/

Runs `torchrun -m hf_contextpar.eval` twice (reports in OUT/needlebench and OUT/bookcorpus) and
exits 0 when both say "equivalent", 1 when either does not, 2 when either could not run. The
verdict is read from report.json, which the harness writes only when a run completes: torchrun
turns every failing rank status into 1, so its own exit status cannot tell the last two apart.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def run(kind: str, args, extra: list[str]) -> int:
    out = os.path.join(args.out, kind)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(args.nproc),
        "-m",
        "hf_contextpar.eval",
        kind,
        "--model",
        args.model,
        "--dtype",
        args.dtype,
        "--strategy",
        args.strategy,
        "--out",
        out,
        *extra,
    ]
    print("$ " + " ".join(cmd[1:]), flush=True)
    report = os.path.join(out, "report.json")
    if os.path.isfile(report):  # an earlier run's: a run that fails before writing must not pass on it
        os.remove(report)
    subprocess.run(cmd)
    try:
        with open(report) as f:
            verdict = json.load(f)["summary"]["verdict"]
    except FileNotFoundError:
        print(f"{kind}: could not run (no report); see the output above.")
        return 2
    print(f"{kind}: {verdict} (details in {os.path.join(out, 'report.md')})")
    return 0 if verdict == "equivalent" else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--model", default="needle-lm")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--strategy", default="auto")
    p.add_argument("--lengths", default="1024,2048")
    p.add_argument("--depths", default="0,50,100")
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--num-windows", type=int, default=2)
    p.add_argument("--out", default="eval_gate")
    args = p.parse_args()
    statuses = [
        run("needlebench", args, ["--lengths", args.lengths, "--depths", args.depths]),
        run("bookcorpus", args, ["--window", str(args.window), "--num-windows", str(args.num_windows)]),
    ]
    return max(statuses)


if __name__ == "__main__":
    sys.exit(main())
