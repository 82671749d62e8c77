"""What both harness commands share: start-up (process group, model, a check that it can be
patched), the tolerance, the summary and reports, and saving a single-process reference."""

from __future__ import annotations

import os
import sys
import time

import torch
from hf_contextpar.patches import REGISTRY

import hf_contextpar
from hf_contextpar.models import DTYPES, load

from . import report
from .harness import Dist, on_rank0, save_reference
from .oracle import internals_error, kernel_swap, tolerance

EXIT_NOT_EQUIVALENT, EXIT_ERROR = 1, 2


def ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--{what} takes comma-separated integers, got {text!r}.") from None
    if not values:
        raise SystemExit(f"--{what} is empty.")
    return values


def setup(args):
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.reference and args.save_reference:
        raise SystemExit(
            "use either --reference FILE (read a saved single-process run) or --save-reference FILE (make one)."
        )
    cuda = torch.cuda.is_available() and not args.cpu
    d = Dist(args.timeout, cuda, getattr(args, "cp_size", None))
    if args.save_reference and d.world > 1:
        raise SystemExit(
            "--save-reference records the single-process run: start it as one process "
            "(python -m hf_contextpar.eval ...), then run the N-process job with --reference FILE."
        )
    if d.rank != 0:
        import transformers

        transformers.logging.set_verbosity_error()
    on_rank0(d, lambda: prepare_out(args))  # an unwritable --out fails now, not after the run
    model, tok = load(args.model, DTYPES[args.dtype], d.device)
    if not args.save_reference:  # fail now, with the library's message, if this model cannot be patched
        try:
            hf_contextpar.apply_context_parallel(model, strategy=args.strategy, group=d.group)
        except (hf_contextpar.ContextParallelError, ValueError) as e:
            raise SystemExit(f"cannot run this model with context parallelism: {e}") from None
        hf_contextpar.remove_context_parallel(model)
    return d, model, tok


def prepare_out(args):
    """Create the output directory (an unwritable one fails before the run; main() has already dropped
    a previous run's reports there)."""
    if args.save_reference:
        os.makedirs(os.path.dirname(os.path.abspath(args.save_reference)), exist_ok=True)
        return
    os.makedirs(args.out, exist_ok=True)


def drop_reports(out: str):
    """Drop a previous run's reports, so that OUT/report.json exists exactly when this run completed
    (launchers report every failing status as 1; the report tells which)."""
    for name in report.FILES:
        path = os.path.join(out, name)
        if os.path.isfile(path):
            os.remove(path)


def weights_fingerprint(model) -> float:
    """A fingerprint of the weights, so a reference saved for other weights under the same name is refused."""
    with torch.no_grad():
        return float(
            sum(p.flatten()[::101].double().sum() for p in model.parameters())
        )  # no fp64 copy of a whole tensor


def run_tolerance(args, d, model, first_ids, longest_ids=None):
    """(tolerance, how it was chosen, measured kernel swap or None): --tolerance, else the oracle's
    for the model's dtype (bf16/fp16: the kernel swap measured on rank 0 on the first prompt; fp64, a model
    with fp32 internals (a hybrid, or a family whose census bound is wider than 1e-10): twice its own
    fp32-internals error measured on rank 0 on the longest prompt, where that is wider than the family's)."""
    dtype = DTYPES[args.dtype]
    if args.tolerance is not None:
        return args.tolerance, "given with --tolerance", None
    ks = internals = None
    if dtype not in (torch.float32, torch.float64):
        ids = torch.tensor([first_ids[:2048]], device=d.device)
        ks = on_rank0(d, lambda: kernel_swap(model, ids))
    family = REGISTRY.get(model.config.model_type)
    if dtype == torch.float64 and family is not None and (family.recurrent or family.fp64_tolerance > 1e-10):
        ids = torch.tensor([longest_ids if longest_ids is not None else first_ids], device=d.device)
        internals = on_rank0(d, lambda: internals_error(model, ids))
    tol, rule = tolerance(dtype, model.config.model_type, ks, internals_error=internals)
    return tol, rule, ks


def base_summary(args, d, source, rule, ks, warning) -> dict:
    reference = (
        f"saved single-process run {args.reference}" if args.reference else "unpatched model on one process, same run"
    )
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


def finish(args, d, kind, records, tol, base, started) -> int:
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


def save_references(args, task, meta, cases, ref_fn) -> int:
    """--save-reference: run every case on the unpatched model (one process) and save the results."""
    from tqdm import tqdm

    refs = {c["key"]: ref_fn(c) for c in tqdm(cases, desc="reference", dynamic_ncols=True)}
    save_reference(args.save_reference, task, meta, refs)
    print(f"saved the single-process reference of {len(cases)} {task} cases to {args.save_reference}")
    return 0
