"""`python -m hf_contextpar.eval needlebench|bookcorpus`: is the context-parallel model the same model?

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
import time

import torch

import hf_contextpar
from hf_contextpar.tools.cliargs import nonnegative_int, positive_int
from hf_contextpar.tools.models import DEFAULT_MODEL, DTYPES, is_builtin, load, max_positions

from . import bookcorpus as bc
from . import needlebench as nb
from . import report
from .compare import compare_generation, tolerance, window_metrics
from .harness import Dist, fingerprint, kernel_swap, load_reference, on_rank0, run_rounds, save_reference

EXIT_NOT_EQUIVALENT, EXIT_ERROR = 1, 2


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--{what} takes comma-separated integers, got {text!r}.") from None
    if not values:
        raise SystemExit(f"--{what} is empty.")
    return values


def _setup(args):
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.reference and args.save_reference:
        raise SystemExit(
            "use either --reference FILE (read a saved single-process run) or --save-reference FILE (make one)."
        )
    cuda = torch.cuda.is_available() and not args.cpu
    d = Dist(args.timeout, cuda)
    if args.save_reference and d.world > 1:
        raise SystemExit(
            "--save-reference records the single-process run: start it as one process "
            "(python -m hf_contextpar.eval ...), then run the N-process job with --reference FILE."
        )
    if d.rank != 0:
        import transformers

        transformers.logging.set_verbosity_error()
    on_rank0(d, lambda: _prepare_out(args))  # an unwritable --out fails now, not after the run
    model, tok = load(args.model, DTYPES[args.dtype], d.device)
    if not args.save_reference:  # fail now, with the library's message, if this model cannot be patched
        try:
            hf_contextpar.apply_context_parallel(model, strategy=args.strategy, group=d.group)
        except (hf_contextpar.ContextParallelError, ValueError) as e:
            raise SystemExit(f"cannot run this model with context parallelism: {e}") from None
        hf_contextpar.remove_context_parallel(model)
    return d, model, tok


def _prepare_out(args):
    """Create the output directory (an unwritable one fails before the run; main() has already dropped
    a previous run's reports there)."""
    if args.save_reference:
        os.makedirs(os.path.dirname(os.path.abspath(args.save_reference)), exist_ok=True)
        return
    os.makedirs(args.out, exist_ok=True)


def _drop_reports(out: str):
    """Drop a previous run's reports, so that OUT/report.json exists exactly when this run completed
    (launchers report every failing status as 1; the report tells which)."""
    for name in report.FILES:
        path = os.path.join(out, name)
        if os.path.isfile(path):
            os.remove(path)


def _weights(model) -> float:
    """A fingerprint of the weights, so a reference saved for other weights under the same name is refused."""
    with torch.no_grad():
        return float(
            sum(p.flatten()[::101].double().sum() for p in model.parameters())
        )  # no fp64 copy of a whole tensor


def _tolerance(args, d, model, first_ids):
    dtype = DTYPES[args.dtype]
    if args.tolerance is not None:
        return args.tolerance, "given with --tolerance", None
    ks = None
    if dtype not in (torch.float32, torch.float64):
        ids = torch.tensor([first_ids[:2048]], device=d.device)
        ks = on_rank0(d, lambda: kernel_swap(model, ids))
    tol, rule = tolerance(dtype, model.config.model_type, ks)
    return tol, rule, ks


def _base(args, d, source, reference, rule, ks, warning) -> dict:
    return dict(
        model=args.model,
        dtype=args.dtype,
        world=d.world,
        strategy=args.strategy,
        source=source,
        reference=reference,
        tolerance_rule=rule,
        kernel_swap=ks,
        warning=warning,
    )


def _finish(args, d, kind, records, tol, base, started) -> int:
    summary = report.summarize(records, dict(kind=kind, **base), tol)
    summary["wall_seconds"] = round(time.perf_counter() - started, 1)
    failed = None
    if d.rank == 0:
        try:
            paths = report.write(args.out, summary, records)
            print("\n".join(report.summary_lines(summary)))
            print("  wrote " + ", ".join(paths))
            sys.stdout.flush()
        except Exception as e:  # noqa: BLE001 - re-raised after the peers are released
            failed = e
    d.close()
    if failed is not None:
        raise failed
    return 0 if summary["verdict"] == "equivalent" else EXIT_NOT_EQUIVALENT


# -- NeedleBench -------------------------------------------------------------------------------
@torch.no_grad()
def _greedy(model, ids, max_new_tokens, tok):
    """Greedy generate; returns (new tokens, (steps, V) logits in the model's dtype).

    The logits are captured by a forward hook, not taken from `output_logits`: generate() casts
    those to fp32, which would round fp64 differences of 1e-15 into fp32 ulps of 1e-7. The hook
    is registered after the context-parallel hooks, so it sees the gathered logits.
    """
    from transformers import GenerationConfig

    steps = []
    handle = model.register_forward_hook(lambda m, a, out: steps.append(out.logits[0, -1].detach().cpu()))
    gc = model.generation_config
    cfg = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        eos_token_id=gc.eos_token_id,
        bos_token_id=gc.bos_token_id,
        pad_token_id=gc.pad_token_id if gc.pad_token_id is not None else tok.pad_token_id,
    )
    x = torch.tensor([ids], device=next(model.parameters()).device)
    try:
        out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg)
    finally:
        handle.remove()
    new = out[0, x.shape[1] :].cpu()
    return new, torch.stack(steps[: new.numel()])


def _needle_spec(text: str | None):
    """--needles: None (one seeded needle per run, NeedleBench's way), "all", or a list of indices."""
    if text is None:
        return None
    return "all" if text.strip() == "all" else _ints(text, "needles")


def cmd_needlebench(args) -> int:
    started = time.perf_counter()
    lengths, depths = _ints(args.lengths, "lengths"), _ints(args.depths, "depths")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if bad := [t for t in tasks if t not in nb.TASKS]:
        raise SystemExit(f"unknown task(s) {bad}; choose from {', '.join(nb.TASKS)}.")
    if bad := [x for x in depths if not 0 <= x <= 100]:
        raise SystemExit(f"depths are percentages of the haystack, 0..100; got {bad}.")
    needles = _needle_spec(args.needles)
    d, model, tok = _setup(args)
    limit = max_positions(model)
    if limit is not None and max(lengths) + args.max_new_tokens > limit:
        raise SystemExit(
            f"length {max(lengths)} + {args.max_new_tokens} new tokens exceeds the model's context "
            f"(max_position_embeddings = {limit}); use --lengths up to {limit - args.max_new_tokens}."
        )

    def build():
        data, warning = nb.load_data(args.source, args.data, is_builtin(args.model))
        prompts = nb.build_cases(
            data,
            tok,
            tasks,
            lengths,
            depths,
            seed=args.seed,
            num_needles=args.num_needles,
            reasoning_needles=args.reasoning_needles,
            spacing=args.spacing,
            chat=not args.no_chat_template,
            needles=list(range(len(data.needles))) if needles == "all" else needles,
        )
        return (
            data.source,
            warning,
            [
                dict(task=p.task, length=p.length, depth=p.depth, needle=p.needle, ids=p.ids, keywords=p.keywords)
                for p in prompts
            ],
        )

    source, warning, prompts = on_rank0(d, build)
    if warning and d.rank == 0:
        print(f"warning: {warning}", file=sys.stderr)
    cases = [
        dict(
            p,
            index=i,
            key=f"{p['task']}/{p['length']}/{p['depth']}" + ("" if p["needle"] is None else f"/needle{p['needle']}"),
            label=f"{p['task']} {p['length']} tokens depth {p['depth']}%"
            + ("" if p["needle"] is None else f" needle {p['needle']}"),
        )
        for i, p in enumerate(prompts)
    ]
    meta = dict(
        model=args.model, dtype=args.dtype, max_new_tokens=args.max_new_tokens, source=source, weights=_weights(model)
    )

    def ref_fn(model, case):
        tokens, logits = _greedy(model, case["ids"], args.max_new_tokens, tok)
        return dict(prompt_sha=fingerprint(case["ids"]), tokens=tokens, logits=logits)

    if args.save_reference:
        return _save_reference(args, "needlebench", meta, cases, lambda c: ref_fn(model, c))
    reference = load_reference(args.reference, "needlebench", cases, meta) if args.reference else None
    tol, rule, ks = _tolerance(args, d, model, cases[0]["ids"])

    def compare_fn(case, ref, out):
        cp_tokens, cp_logits = out
        rec = compare_generation(ref["tokens"], ref["logits"], cp_tokens, cp_logits)
        ref_answer = tok.decode(ref["tokens"], skip_special_tokens=True)
        cp_answer = tok.decode(cp_tokens, skip_special_tokens=True)
        rec.update(
            key=case["key"],
            task=case["task"],
            length=case["length"],
            depth=case["depth"],
            needle=case["needle"],
            prompt_tokens=len(case["ids"]),
            keywords=case["keywords"],
            ref_answer=ref_answer,
            cp_answer=cp_answer,
            ref_score=nb.score(case["task"], ref_answer, case["keywords"]),
            cp_score=nb.score(case["task"], cp_answer, case["keywords"]),
            new_tokens=[int(ref["tokens"].numel()), int(cp_tokens.numel())],
        )
        rec["near_tie"] = rec["divergence_margin"] is not None and rec["divergence_margin"] <= 2 * tol
        identical = rec["tokens_identical"] or (args.allow_near_ties and rec["near_tie"])
        rec["equivalent"] = identical and rec["max_logit_diff"] <= tol
        return rec

    records = run_rounds(
        d,
        model,
        cases,
        strategy=args.strategy,
        reference=reference,
        ref_fn=ref_fn,
        cp_fn=lambda m, c: _greedy(m, c["ids"], args.max_new_tokens, tok),
        compare_fn=compare_fn,
        desc=f"needlebench N={d.world}",
    )
    ref_desc = (
        f"saved single-process run {args.reference}" if args.reference else "unpatched model on one process, same run"
    )
    base = _base(args, d, source, ref_desc, rule, ks, warning)
    base.update(
        tasks=tasks,
        lengths=lengths,
        depths=depths,
        max_new_tokens=args.max_new_tokens,
        allow_near_ties=args.allow_near_ties,
    )
    return _finish(args, d, "needlebench", records, tol, base, started)


def _save_reference(args, task, meta, cases, ref_fn) -> int:
    """--save-reference: run every case on the unpatched model (one process) and save the results."""
    refs = {c["key"]: ref_fn(c) for c in _progress(cases, "reference")}
    save_reference(args.save_reference, task, meta, refs)
    print(f"saved the single-process reference of {len(cases)} {task} cases to {args.save_reference}")
    return 0


def _progress(items, desc):
    from tqdm import tqdm

    return tqdm(items, desc=desc, dynamic_ncols=True)


# -- BookCorpus --------------------------------------------------------------------------------
def cmd_bookcorpus(args) -> int:
    started = time.perf_counter()
    if args.window < 2:  # --num-windows is checked while parsing
        raise SystemExit("--window must be at least 2 tokens.")
    d, model, tok = _setup(args)
    limit = max_positions(model)
    if limit is not None and args.window > limit:
        raise SystemExit(f"--window {args.window} exceeds the model's context (max_position_embeddings = {limit}).")

    def build():
        bos = bc.uses_bos(tok)
        need = args.num_windows * (args.window - (bos is not None))
        ids, where, warning = bc.load_token_stream(
            tok,
            need,
            source=args.source,
            data=args.data,
            dataset_id=args.dataset_id,
            revision=args.revision or None,
            column=args.text_column,
            builtin_model=is_builtin(args.model),
        )
        return where, warning, bc.windows(ids, args.window, args.num_windows, bos)

    source, warning, wins = on_rank0(d, build)
    if warning and d.rank == 0:
        print(f"warning: {warning}", file=sys.stderr)
    cases = [dict(index=i, key=f"window/{i}", label=f"window {i}", ids=w) for i, w in enumerate(wins)]
    meta = dict(model=args.model, dtype=args.dtype, window=args.window, source=source, weights=_weights(model))

    @torch.no_grad()
    def forward(model, case):
        x = torch.tensor([case["ids"]], device=d.device)
        return model(x, use_cache=False).logits[0]

    if args.save_reference:
        return _save_reference(
            args,
            "bookcorpus",
            meta,
            cases,
            lambda c: dict(prompt_sha=fingerprint(c["ids"]), logits=forward(model, c).cpu()),
        )
    reference = load_reference(args.reference, "bookcorpus", cases, meta) if args.reference else None
    tol, rule, ks = _tolerance(args, d, model, cases[0]["ids"])

    def compare_fn(case, ref, cp_logits):
        ref_logits = ref["logits"] if isinstance(ref, dict) else ref
        rec = window_metrics(ref_logits, cp_logits, torch.tensor(case["ids"]))
        rec.update(key=case["key"], window=case["index"], tokens=len(case["ids"]))
        rec["equivalent"] = rec["max_logit_diff"] <= tol
        return rec

    records = run_rounds(
        d,
        model,
        cases,
        strategy=args.strategy,
        reference=reference,
        ref_fn=forward,
        cp_fn=forward,
        compare_fn=compare_fn,
        desc=f"bookcorpus N={d.world}",
    )
    ref_desc = (
        f"saved single-process run {args.reference}" if args.reference else "unpatched model on one process, same run"
    )
    base = _base(args, d, source, ref_desc, rule, ks, warning)
    base.update(window=args.window, num_windows=args.num_windows)
    return _finish(args, d, "bookcorpus", records, tol, base, started)


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


TOLERANCE_HELP = (
    "tolerance on max |logit diff| (context-parallel vs one process): float64 1e-10 (Gemma2 1e-5), "
    "float32 1e-4, bfloat16/float16 max(the diff that switching the unpatched model between eager and "
    "SDPA attention causes on the first prompt, 1e-2). Generated tokens must be identical."
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
    args = p.parse_args(argv)
    if not args.save_reference and os.environ.get("RANK", "0") == "0":
        _drop_reports(args.out)  # before anything can fail: OUT/report.json must not outlive a run that did
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
