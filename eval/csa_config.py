"""`python -m hf_contextpar.eval csa-config`: CSPS's objective-oriented configuring (3.2.6), measured.

    torchrun --nproc_per_node 4 -m hf_contextpar.eval csa-config --topology 2x2 --max-accuracy-drop 0 \\
        --lengths 2048,4096 --out csa/

It runs the calibration split, which `eval csa` never scores: NeedleBench's odd-numbered needles (the
evaluation has the even ones) and BookCorpus's odd-numbered windows. It runs the split exactly first, then
under CSA for each level-2 keep fraction of the grid, from the largest down; each farther level keeps half of
the level before it, as the paper derives its drop ratios. It stops at the first fraction that breaks a
constraint, the paper's early stop, and keeps the smallest fraction that met both. The constraints: the mean
NeedleBench score may fall at most --max-accuracy-drop points below the exact run's, and the perplexity may
rise at most --max-ppl-increase percent. It prints the curve (keep fraction, score, its drop, the perplexity
rise, attention bytes against keep-all, the slowest rank's prefill seconds) and writes the chosen settings,
with the curve, to OUT/csa_settings.json. Those settings load with `--csa FILE` (generate, eval csa) or `CSA.load(FILE)`.
"""

from __future__ import annotations

import os
import sys
import time

from hf_contextpar.sparse import CSA

from .common import setup
from .csa_cmd import distributed_runs, needle_cases
from .needlebench import score


def add_arguments(p) -> None:
    p.add_argument("--max-accuracy-drop", type=float, default=0.0, help="points of mean score CSA may lose (default 0)")
    p.add_argument("--grid", default="1.0,0.9,0.8,0.7,0.6,0.5,0.4,0.3,0.2", help="level-2 keep fractions to try")
    p.add_argument("--topology", help="AxB: A nodes of B ranks (default: from the launcher)")
    p.add_argument("--observe", type=int, default=64, help="query rows that rank a partition's keys (default 64)")
    p.add_argument("--lengths", default="2048,4096", help="calibration prompt lengths (default 2048,4096)")
    p.add_argument("--depths", default="0,50,100", help="needle depths in %% of the haystack (default 0,50,100)")
    p.add_argument("--tasks", default="single_retrieval,multi_retrieval", help="NeedleBench tasks")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument(
        "--max-ppl-increase", type=float, default=1.0, help="%% BookCorpus perplexity CSA may add (default 1)"
    )
    p.add_argument("--window", type=int, default=2048, help="BookCorpus calibration tokens per window (default 2048)")
    p.add_argument("--num-windows", type=int, default=1, help="BookCorpus calibration windows (0: none; default 1)")


def cmd_csa_config(args) -> int:
    started = time.perf_counter()
    args.reference = args.save_reference = None
    try:
        grid = sorted({float(x) for x in args.grid.split(",") if x.strip()}, reverse=True)
        CSA(keep=grid[-1], topology=args.topology, observe=args.observe)
    except (ValueError, IndexError) as e:
        raise SystemExit(f"--grid / --topology / --observe: {e}") from None
    d, model, tok = setup(args)
    if d.replicas > 1:
        raise SystemExit("error: csa runs one CP group of every process; leave --cp-size and PARALLELISM_CONFIG_* out.")
    cases = _on_rank0_cases(d, args, tok)
    exact = distributed_runs(d, model, tok, cases, args, dict(strategy=args.strategy))
    exact_score = _mean_score(cases, exact, tok)
    windows = [i for i, c in enumerate(cases) if c["kind"] == "window"]
    keep_all = distributed_runs(d, model, tok, cases, args, dict(sparse=_csa(args, (1.0,) * 3)), results=False)
    all_bytes = sum(sum(r["bytes_sent"]) for r in keep_all)
    curve, chosen = [], None
    for keep in grid:
        runs = distributed_runs(d, model, tok, cases, args, dict(sparse=_csa(args, keep)))
        point = dict(
            keep=keep,
            score=_mean_score(cases, runs, tok),
            bytes_vs_keep_all=sum(sum(r["bytes_sent"]) for r in runs) / all_bytes if all_bytes else None,
            ttft_s=_slowest(runs),
        )
        point["drop"] = exact_score - point["score"]
        point["ppl_increase_pct"] = _ppl_increase(exact, runs, windows)
        curve.append(point)
        if point["drop"] > args.max_accuracy_drop + 1e-9 or (point["ppl_increase_pct"] or 0) > args.max_ppl_increase:
            break  # the paper's early stop: a smaller fraction drops more
        chosen = keep
    if d.rank == 0:
        _report(args, d, curve, chosen, exact_score, _slowest(exact), _slowest(keep_all), started)
    d.close()
    return 0 if chosen is not None else 1


def _on_rank0_cases(d, args, tok):
    from .harness import on_rank0

    return on_rank0(d, lambda: needle_cases(args, tok, "calibration"))


def _csa(args, keep) -> CSA:
    return CSA(keep=keep, topology=args.topology, observe=args.observe)


def _mean_score(cases, runs, tok) -> float:
    scores = [
        score(c["task"], tok.decode(r["tokens"], skip_special_tokens=True), c["keywords"])
        for c, r in zip(cases, runs)
        if c["kind"] == "needle"
    ]
    return sum(scores) / len(scores)


def _ppl_increase(exact, runs, windows) -> float | None:
    """% perplexity CSA adds over the exact run, mean over the calibration windows (None without windows)."""
    if not windows:
        return None
    return 100 * (sum(runs[i]["ppl"] / exact[i]["ppl"] for i in windows) / len(windows) - 1)


def _slowest(runs) -> float:
    return sum(max(r["ttft_s"]) for r in runs) / len(runs)


def _report(args, d, curve, chosen, exact_score, exact_ttft, keep_all_ttft, started):
    print(f"csa-config: {args.model}, N = {d.world}, calibration split, exact mean score {exact_score:.1f}")
    print(f"  exact prefill {exact_ttft:.3f} s, keep-all CSA {keep_all_ttft:.3f} s (slowest rank, mean over prompts)")
    print("  keep (level 2) | score | drop | ppl +% | bytes vs keep-all | prefill s")
    for p in curve:
        ppl = "-" if p["ppl_increase_pct"] is None else f"{p['ppl_increase_pct']:.2f}"
        print(
            f"  {p['keep']:>14g} | {p['score']:5.1f} | {p['drop']:4.1f} | {ppl:>6} | {p['bytes_vs_keep_all']:17.3f} "
            f"| {p['ttft_s']:.3f}"
        )
    if chosen is None:
        print(
            f"  no keep fraction of the grid stays within --max-accuracy-drop {args.max_accuracy_drop} and "
            f"--max-ppl-increase {args.max_ppl_increase}"
        )
        return
    csa = _csa(args, chosen)
    path = csa.save(
        os.path.join(args.out, "csa_settings.json"),
        max_accuracy_drop=args.max_accuracy_drop,
        max_ppl_increase=args.max_ppl_increase,
        model=args.model,
        world=d.world,
        exact_score=exact_score,
        curve=curve,
        wall_seconds=round(time.perf_counter() - started, 1),
    )
    print(f"  chosen: keep {chosen:g} ({csa.resolved(d.world).describe()}); wrote {path} (use --csa {path})")
    sys.stdout.flush()


__all__ = ["add_arguments", "cmd_csa_config"]
