"""`python -m hf_contextpar.eval csa`: what the approximate mode (CSA) costs, beside the exact run and one process.

    torchrun --nproc_per_node 4 -m hf_contextpar.eval csa --csa 0.8 --topology 2x2 \\
        --lengths 2048,4096,8192,16384 --depths 0,25,50,75,100 --num-windows 2 --out csa/

One report with, per NeedleBench cell (single and multi-needle, lengths x depths):
- the score of the unpatched model on one process, of the exact context-parallel run and of CSA;
- whether the exact run's tokens are the one process's (they must be);
- whether CSA's tokens are its one-process reference's (eval/csa_reference.py: the same definition as a
  mask, so the sparse path is checked against itself).

Per BookCorpus window, the perplexity of all three. The attention bytes each rank sends and its time to
first token, exact against CSA, come from the same prompts, timed side by side. Exits 0 when both
checks hold for every case, 1 when one does not, 2 when it could not run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace

import torch

import hf_contextpar
from hf_contextpar.cliargs import add_csa_arguments, csa_setting
from hf_contextpar.models import is_builtin
from hf_contextpar.sparse import CSA

from . import bookcorpus as bc
from . import needlebench as nb
from .common import EXIT_NOT_EQUIVALENT, ints, setup
from .compare import window_metrics
from .csa_reference import csa_reference
from .csa_strategies import CSA_EVEN, CSA_RUN, exact_strategies, strategy_lines, strategy_summary, time_strategies
from .harness import on_rank0
from .needlebench_cmd import greedy


def add_arguments(p) -> None:
    add_csa_arguments(p, required=True)
    p.add_argument("--lengths", default="2048,4096", help="NeedleBench prompt lengths (default 2048,4096)")
    p.add_argument("--depths", default="0,50,100", help="needle depths in %% of the haystack (default 0,50,100)")
    p.add_argument("--tasks", default="single_retrieval,multi_retrieval", help="NeedleBench tasks")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--window", type=int, default=2048, help="BookCorpus tokens per window (default 2048)")
    p.add_argument("--num-windows", type=int, default=2, help="BookCorpus windows (0: none; default 2)")
    p.add_argument(
        "--exact-strategies",
        default="none",
        help="also time these exact prefill strategies on the same prompts beside CSA, per rank, and name the "
        "fastest: 'all' (each that applies), a comma-separated list, or none (default: the exact run alone)",
    )


def cmd_csa(args) -> int:
    started = time.perf_counter()
    csa = csa_setting(args)
    names = exact_strategies(args.exact_strategies)
    args.reference = args.save_reference = None  # this command computes its references itself
    d, model, tok = setup(args)
    if d.replicas > 1:
        raise SystemExit("error: csa runs one CP group of every process; leave --cp-size and PARALLELISM_CONFIG_* out.")
    try:  # this model under CSA: refused now, with the library's message, rather than half-way
        hf_contextpar.apply_context_parallel(model, group=d.group, sparse=csa)
    except (hf_contextpar.ContextParallelError, ValueError) as e:
        raise SystemExit(f"cannot run this model under CSA: {e}") from None
    hf_contextpar.remove_context_parallel(model)
    cases = on_rank0(d, lambda: needle_cases(args, tok))
    exact = distributed_runs(d, model, tok, cases, args, dict(strategy=args.strategy))
    sparse = distributed_runs(d, model, tok, cases, args, dict(sparse=csa))
    # the same placement keeping every token: what CSA's bytes and time would be without the dropping
    every = CSA(keep=(1.0,) * 3, topology=csa.topology, observe=csa.observe)
    kept = distributed_runs(d, model, tok, cases, args, dict(sparse=every), results=False)
    timed, skipped = time_strategies(
        d, names, lambda how: distributed_runs(d, model, tok, cases, args, how, results=False)
    )
    if names:  # CSA on even partitions beside its balanced default: what the balancing buys
        timed[CSA_EVEN] = distributed_runs(d, model, tok, cases, args, dict(sparse=csa, partitions="even"), False)
    # after CSA's run: its reference cuts each prompt as that run's result did (placement decides levels)
    one = _one_process(d, model, tok, cases, csa, args, [s["partitions"] for s in sparse])
    records = [_record(c, o, e, s, k, tok) for c, o, e, s, k in zip(cases, one, exact, sparse, kept)]
    summary = _summary(records, csa.resolved(d.world).describe(), args, d.world, time.perf_counter() - started)
    if names:
        runs = {**timed, f"exact run ({args.strategy})": exact, CSA_RUN: sparse}
        summary["strategies"] = strategy_summary(cases, runs, f"exact run ({args.strategy})", skipped)
    if d.rank == 0:
        _write(args.out, summary, records)
    d.close()
    return 0 if summary["exact_equivalent"] and summary["csa_matches_reference"] else EXIT_NOT_EQUIVALENT


SPLITS = ("evaluation", "calibration")


def split(data: nb.NeedleData, part: str) -> nb.NeedleData:
    """The needles of one split: evaluation takes the even-numbered ones, calibration (csa-config) the odd, so
    the settings the configurator picks never saw an evaluation needle (BookCorpus windows alternate the same way)."""
    return replace(data, needles=data.needles[SPLITS.index(part) :: 2])


def needle_cases(args, tok, part: str = "evaluation") -> list:
    """NeedleBench prompts of one split, then BookCorpus windows, as dicts every rank receives from rank 0."""
    data, _ = nb.load_data(args.source, args.data, is_builtin(args.model))
    data = split(data, part)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    prompts = nb.build_cases(
        data, tok, tasks, ints(args.lengths, "lengths"), ints(args.depths, "depths"), seed=args.seed
    )
    out = [
        dict(
            kind="needle",
            key=f"{p.task}/{p.length}/{p.depth}",
            task=p.task,
            length=p.length,
            depth=p.depth,
            ids=p.ids,
            keywords=p.keywords,
        )
        for p in prompts
    ]
    if args.num_windows > 0:
        bos = bc.uses_bos(tok)
        need = 2 * args.num_windows * (args.window - (bos is not None))  # both splits' windows, alternating
        ids, _, _ = bc.load_token_stream(
            tok,
            need,
            source=args.source,
            data=args.data,
            dataset_id=bc.HUB_ID,
            revision=bc.HUB_REVISION,
            column="text",
            builtin_model=is_builtin(args.model),
        )
        wins = bc.windows(ids, args.window, 2 * args.num_windows, bos)[SPLITS.index(part) :: 2]
        out += [dict(kind="window", key=f"window/{i}", ids=w) for i, w in enumerate(wins)]
    return out


@torch.no_grad()
def _run(model, tok, case, args, device) -> dict:
    """A needle case's greedy answer, or a window's full logits (on the CPU)."""
    if case["kind"] == "needle":
        return dict(tokens=greedy(model, case["ids"], args.max_new_tokens, tok)[0])
    return dict(logits=model(torch.tensor([case["ids"]], device=device), use_cache=False).logits[0].cpu())


def _one_process(d, model, tok, cases, csa, args, partitions) -> list:
    """Per case, the unpatched model's result and CSA's one-process reference (on the partitions CSA's run cut for
    that case's result), each rank taking every N-th case."""
    mine = {}
    for i in range(d.rank, len(cases), d.world):
        plain = _run(model, tok, cases[i], args, d.device)
        with csa_reference(model, csa, d.world, partitions[i]):
            ref = _run(model, tok, cases[i], args, d.device)
        mine[i] = dict(plain=_digest(cases[i], plain), reference=_digest(cases[i], ref))
    gathered = {i: r for part in d.all_gather(mine) for i, r in part.items()}
    return [gathered[i] for i in range(len(cases))]


def _digest(case, out) -> dict:
    """What the report keeps of a result: a needle's tokens, a window's perplexity."""
    if case["kind"] == "needle":
        return dict(tokens=out["tokens"].tolist())
    ids = torch.tensor(case["ids"])
    return dict(ppl=window_metrics(out["logits"], out["logits"], ids)["ppl_ref"])


def distributed_runs(d, model, tok, cases, args, how: dict, results: bool = True) -> list:
    """Per case on every rank: the result, each rank's prefill seconds and attention bytes (side by side: the
    same prompts, one setting after the other)."""
    hf_contextpar.apply_context_parallel(model, group=d.group, **how)
    runtime = hf_contextpar.get_runtime(model)
    out = []
    try:
        for case in cases:
            x = torch.tensor([case["ids"]], device=d.device)
            d.barrier()
            t0 = time.perf_counter()
            with torch.no_grad():
                model(x, use_cache=False, logits_to_keep=1)
            ttft = time.perf_counter() - t0
            sent = runtime.last_forward["bytes_sent"] if runtime else 0
            per_rank = d.all_gather((round(ttft, 4), int(sent)))
            cut = runtime.partitions(len(case["ids"])) if runtime else None  # what the result's prefill cuts
            res = _digest(case, _run(model, tok, case, args, d.device)) if results else {}
            out.append(dict(res, ttft_s=[t for t, _ in per_rank], bytes_sent=[b for _, b in per_rank], partitions=cut))
    finally:
        hf_contextpar.remove_context_parallel(model)
    return out


def _record(case, one, exact, sparse, kept, tok) -> dict:
    rec = dict(
        key=case["key"],
        kind=case["kind"],
        exact_ttft_s=exact["ttft_s"],
        csa_ttft_s=sparse["ttft_s"],
        keep_all_ttft_s=kept["ttft_s"],
        exact_bytes=exact["bytes_sent"],
        csa_bytes=sparse["bytes_sent"],
        keep_all_bytes=kept["bytes_sent"],
        csa_partitions=sparse["partitions"],  # its result's prefill's (balanced by default): its reference's too
    )
    if case["kind"] == "needle":

        def score(tokens):
            return nb.score(case["task"], tok.decode(tokens, skip_special_tokens=True), case["keywords"])

        rec.update(
            task=case["task"],
            length=case["length"],
            depth=case["depth"],
            score_one=score(one["plain"]["tokens"]),
            score_exact=score(exact["tokens"]),
            score_csa=score(sparse["tokens"]),
            exact_identical=exact["tokens"] == one["plain"]["tokens"],
            csa_matches_reference=sparse["tokens"] == one["reference"]["tokens"],
        )
    else:
        rec.update(
            ppl_one=one["plain"]["ppl"],
            ppl_exact=exact["ppl"],
            ppl_csa=sparse["ppl"],
            exact_identical=abs(exact["ppl"] - one["plain"]["ppl"]) <= 1e-3 * one["plain"]["ppl"],
            csa_matches_reference=abs(sparse["ppl"] - one["reference"]["ppl"]) <= 1e-3 * one["reference"]["ppl"],
        )
    return rec


def _summary(records, describe, args, world, wall) -> dict:
    needles = [r for r in records if r["kind"] == "needle"]
    windows = [r for r in records if r["kind"] == "window"]

    def mean(xs):
        return sum(xs) / len(xs) if xs else None

    exact_bytes = sum(sum(r["exact_bytes"]) for r in records)
    csa_bytes = sum(sum(r["csa_bytes"]) for r in records)
    kept_bytes = sum(sum(r["keep_all_bytes"]) for r in records)
    return dict(
        model=args.model,
        dtype=args.dtype,
        world=world,
        csa=describe,
        exact_strategy=args.strategy,
        exact_equivalent=all(r["exact_identical"] for r in records),
        csa_matches_reference=all(r["csa_matches_reference"] for r in records),
        score_one=mean([r["score_one"] for r in needles]),
        score_exact=mean([r["score_exact"] for r in needles]),
        score_csa=mean([r["score_csa"] for r in needles]),
        cells_csa_differs=[r["key"] for r in needles if r["score_csa"] != r["score_exact"]],
        ppl_exact=mean([r["ppl_exact"] for r in windows]),
        ppl_csa=mean([r["ppl_csa"] for r in windows]),
        ppl_delta_pct=(100 * (mean([r["ppl_csa"] / r["ppl_exact"] for r in windows]) - 1)) if windows else None,
        bytes_exact=exact_bytes,
        bytes_csa=csa_bytes,
        bytes_saved_pct=100 * (1 - csa_bytes / exact_bytes) if exact_bytes else None,
        bytes_keep_all=kept_bytes,
        bytes_saved_vs_keep_all_pct=100 * (1 - csa_bytes / kept_bytes) if kept_bytes else None,
        ttft_keep_all_s=mean([max(r["keep_all_ttft_s"]) for r in records]),
        ttft_exact_s=mean([max(r["exact_ttft_s"]) for r in records]),
        ttft_csa_s=mean([max(r["csa_ttft_s"]) for r in records]),
        wall_seconds=round(wall, 1),
    )


def _write(out: str, summary: dict, records: list) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(dict(summary=summary, records=records), f, indent=1)
    lines = [
        f"# CSA against the exact run: {summary['model']} ({summary['dtype']}), N = {summary['world']}",
        "",
        f"{summary['csa']}; exact: strategy {summary['exact_strategy']}.",
        "",
        "| case | one process | exact | CSA | exact = one process | CSA = its reference | bytes exact | bytes CSA "
        "| TTFT exact (s) | TTFT CSA (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        vals = (
            (r["score_one"], r["score_exact"], r["score_csa"])
            if r["kind"] == "needle"
            else (f"ppl {r['ppl_one']:.3f}", f"{r['ppl_exact']:.3f}", f"{r['ppl_csa']:.3f}")
        )
        lines.append(
            f"| {r['key']} | {vals[0]} | {vals[1]} | {vals[2]} | {r['exact_identical']} | {r['csa_matches_reference']} "
            f"| {sum(r['exact_bytes'])} | {sum(r['csa_bytes'])} | {max(r['exact_ttft_s']):.3f} | {max(r['csa_ttft_s']):.3f} |"
        )
    if summary.get("strategies"):
        lines += strategy_lines(summary["strategies"])
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(text)
    for k in (
        "csa",
        "exact_equivalent",
        "csa_matches_reference",
        "score_one",
        "score_exact",
        "score_csa",
        "cells_csa_differs",
        "ppl_exact",
        "ppl_csa",
        "ppl_delta_pct",
        "bytes_saved_pct",
        "bytes_saved_vs_keep_all_pct",
        "ttft_exact_s",
        "ttft_csa_s",
        "ttft_keep_all_s",
        "wall_seconds",
    ):
        print(f"  {k}: {summary[k]}")
    if summary.get("strategies"):
        st = summary["strategies"]
        print(f"  prefill_s_slowest: {st['prefill_s_slowest']}")
        print(f"  fastest_exact: {st['fastest_exact']}  csa_over_fastest_exact: {st['csa_over_fastest_exact']}")
    print(f"  wrote {os.path.join(out, 'report.json')}, {os.path.join(out, 'report.md')}")
    sys.stdout.flush()
