"""The model census (issue 32): every decoder-only text model type of the installed transformers, run
through `apply_context_parallel` against the unpatched model on one process.

The families are transformers' own `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, less what `scope` drops with
a stated reason (encoder-only models, halves of encoder-decoder models, multimodal wrappers;
`configs.scope`). Each
family gets a tiny random config (`configs`: the generic small sizes its config knows, plus a
short table of per-family overrides), fp64
where the unpatched model runs in it (else fp32), is registered by hand
(`patches.register(FamilyPatch(model_type, "census"))`) where the registry does not know it, and is
compared, on every rank, with the unpatched copy of the same weights: one forward of a 61-token
prompt, a greedy generate of 8 tokens, and a second turn (7 more tokens, 8 generated) over the
returned cache. Outcomes:

- exact: every max |logit diff| within the exactness oracle's tolerance, tokens identical (or a
  divergence the oracle's near-tie rule allows);
- refused: a ContextParallelError of the same type on every rank at apply or at the first forward;
- crash: any other exception from the patched run (or a refusal after the first forward, or ranks
  that disagree);
- differs: no error, another answer;
- skipped: the unpatched model itself fails on one process with the tiny config (the reason given), and
  apply does not refuse the family (a refusal at apply is the outcome whatever the input: refused, with a note).

    torchrun --nproc_per_node 2 -m dev.census [--families a,b] [--strategy auto]
        [--json out.json] [--markdown out.md] [--resume]
    torchrun --nproc_per_node N -m dev.census --sweep --json docs/census.json [--families a,b]
    python -m dev.census --from-json docs/census.json --markdown docs/census.md
        --verified patches/verified.py --readme README.md

A family whose tolerance is wider than the oracle's fp64 one, or that differs by an fp32-sized amount with
identical tokens, gets `dev.census.sweep.fp32_internals`: exact within the model's own measured fp32 bound
when ours is fp64-exact with the model's fp32 internals in fp64. `--sweep` (`sweep.py`) re-runs the
exact families under every variant at the launch's N; `report.py` turns the report into the page,
the verified families' module (no opt-in) and README's block.
    python -m dev.census --list
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os
import re
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist
from hf_contextpar.eval.oracle import FLOAT_TOL, first_divergence, logits_diff, near_tie, top2_margin
from transformers.cache_utils import Cache

import hf_contextpar
from dev.census import report as census_report
from dev.census import sweep as census_sweep
from dev.census.configs import MAX_PARAMS, OVERRIDES, build, scope, tiny_config
from hf_contextpar import patches

PROMPT, NEW_TOKENS, SECOND_TURN = 61, 8, 7
TIMEOUT_S = 60.0  # what a rank waits for its peers inside one family's patched run
FP32_NOISE = FLOAT_TOL[torch.float32]


@torch.no_grad()
def conversation(model, ids, more, steps: list, mask=None):
    """Forward logits, then greedy generate with its per-step logits, then (`more` not None) a second turn
    over its cache; `steps` gets each step's name as it starts. `mask`: a left-padded batch's 2D mask."""
    steps.append("forward")
    extra = {} if mask is None else dict(attention_mask=mask)
    out = {"forward": model(ids, **extra).logits}
    gen = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, num_beams=1)
    gen.update(return_dict_in_generate=True, output_logits=True)
    steps.append("generate")
    first = model.generate(ids, **gen, **extra)
    out["tokens1"], out["logits1"] = first.sequences, torch.stack(first.logits, 1)
    if more is not None:
        steps.append("second turn")
        past = first.past_key_values
        if past is not None and not isinstance(past, Cache):  # a state of its own (RWKV's list): as its own tests pass
            # it back, `state=`, with the tokens it has not seen (the last generated one, then the new ones)
            turn2, carried = torch.cat([first.sequences[:, -1:], more], 1), dict(state=past)
        else:
            turn2, carried = torch.cat([first.sequences, more], 1), dict(past_key_values=past)
        if mask is not None:
            grown = first.sequences.shape[1] + more.shape[1] - mask.shape[1]
            extra = dict(attention_mask=torch.cat([mask, mask.new_ones(mask.shape[0], grown)], 1)[:, -turn2.shape[1] :])
        second = model.generate(turn2, **carried, **gen, **extra)
        out["tokens2"], out["logits2"] = second.sequences, torch.stack(second.logits, 1)
    return out


def compare(ref: dict, cp: dict, tol: float, mask=None) -> dict:
    """The oracle's verdict on the patched run against the reference (`mask`: padded positions left out)."""
    worst = logits_diff(cp["forward"], ref["forward"], mask)
    for turn in ("1", "2")[: 2 if "tokens2" in ref else 1]:
        a, b = ref[f"tokens{turn}"], cp[f"tokens{turn}"]
        k = first_divergence(a, b)
        la, lb = ref[f"logits{turn}"], cp[f"logits{turn}"]
        step = None if k is None else k - (a.shape[1] - la.shape[1])
        upto = la.shape[1] if step is None else step
        worst = max(worst, logits_diff(lb[:, :upto], la[:, :upto]) if upto else 0.0)
        if step is not None:
            rows = (a[:, k] != b[:, k]).nonzero().flatten().tolist()
            tie = worst <= tol and all(near_tie(top2_margin(la[r, step]), tol) for r in rows)
            return dict(max_diff=worst, tokens_equal=False, near_tie=tie, diverged=f"turn {turn} step {step}")
    return dict(max_diff=worst, tokens_equal=True, near_tie=False, diverged=None)


def _first_line(e: BaseException) -> str:
    """The message's first line (with the next where it ends in a colon, as a validation error's does)."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()] or [""]
    return " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]


def _short(path: str) -> str:
    """A file of transformers / torch from site-packages on, one of ours from the checkout's root."""
    if "site-packages/" in path:
        return path.split("site-packages/")[-1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(hf_contextpar.__file__)))
    return os.path.relpath(path, root) if path.startswith(root) else path


def error_record(e: BaseException, stage: str) -> dict:
    tb = traceback.extract_tb(e.__traceback__)
    ours = [f for f in tb if "hf_contextpar" in f.filename and "dev/census" not in f.filename]
    where = ours[-1] if ours else (tb[-1] if tb else None)
    frames = traceback.format_exception(e)
    return dict(
        stage=stage,
        type=type(e).__name__,
        refusal=isinstance(e, hf_contextpar.ContextParallelError),
        last_line=f"{type(e).__name__}: {_first_line(e)[:400]}",
        where=f"{_short(where.filename)}:{where.lineno}" if where else "?",
        library_frames=[f"{_short(f.filename)}:{f.lineno} in {f.name}" for f in ours],
        traceback=re.sub(r'File "([^"]+)"', lambda m: f'File "{_short(m[1])}"', "".join(frames))[-1500:],
    )


def reference(model_type: str, ids, more) -> dict:
    """The unpatched model on one process: fp64 where it runs, else fp32; skipped if neither does."""
    known = patches.REGISTRY.get(model_type)
    attn = OVERRIDES.get(model_type, {}).get("_reference") or (known.reference_attn if known else "sdpa")
    try:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            size = sum(p.numel() for p in AutoModelForCausalLM.from_config(tiny_config(model_type)).parameters())
    except Exception as e:
        return dict(failure=error_record(e, "build (meta)"))
    if size > MAX_PARAMS:
        msg = f"the tiny config has {size / 1e6:.0f}M parameters; it needs an entry in census.OVERRIDES"
        return dict(failure=dict(stage="size", type="TooLarge", refusal=False, last_line=msg))
    failure = None
    for dtype in (torch.float64, torch.float32):
        for impl in dict.fromkeys((attn, "eager", "default")):
            try:
                model = build(model_type, dtype, impl)
                cp = copy.deepcopy(model)
            except Exception as e:  # this kernel or dtype is not available: try the next
                failure = error_record(e, f"build ({str(dtype)[6:]}, {impl})")
                continue
            steps, note = [], None
            try:
                out = conversation(model, ids, more, steps)
            except Exception as e:  # the unpatched model fails: try fp32, else a skip, with why
                failure = error_record(e, f"reference {steps[-1] if steps else 'run'} ({str(dtype)[6:]}, {impl})")
                if steps[-1:] != ["second turn"]:
                    break
                note = f"second turn not compared: the unpatched model fails there ({failure['last_line'][:200]})"
                out = conversation(model, ids, None, [])
            return dict(model=cp, dtype=dtype, attn=impl, out=out, note=note)
    return dict(failure=failure)


def _undo(model, key: str, added: bool) -> None:
    """After a census run, finished or not: the model unpatched (what apply did, if it did) and the family the run
    registered for it dropped again."""
    try:
        hf_contextpar.remove_context_parallel(model)
    except Exception:
        pass
    if added:
        patches.REGISTRY.pop(key, None)


def refused_at_apply(model_type: str) -> dict | None:
    """Where the unpatched model fails on the census's input (a drafter that takes another model's states, say):
    apply's refusal of the family, which does not depend on the input, or None (then it is skipped). Opted in by
    hand first, as a family is for its run, so that the refusal is the library's reason and not its opt-in."""
    try:
        model = build(model_type, torch.float32, "default")
    except Exception:
        return None
    key = model.config.model_type
    added = key not in patches.REGISTRY
    if added:
        patches.register(patches.FamilyPatch(key, "census"))
    try:
        hf_contextpar.apply_context_parallel(model, timeout=TIMEOUT_S)
    except hf_contextpar.ContextParallelError as e:
        rec = error_record(e, "apply")
        del rec["traceback"]
        return rec
    finally:
        _undo(model, key, added)
    return None


def run_family(model_type: str, strategy: str) -> dict:
    """This rank's outcome for one family."""
    t0 = time.time()
    rec = dict(family=model_type, class_name=_class_name(model_type))
    g = torch.Generator().manual_seed(61)
    ids = torch.randint(3, 256, (1, PROMPT), generator=g)
    more = torch.randint(3, 256, (1, SECOND_TURN), generator=g)
    ref = reference(model_type, ids, more)
    if "failure" in ref:
        refusal = refused_at_apply(model_type)
        outcome = "skipped" if refusal is None else "refused"
        why = ref["failure"] if refusal is None else refusal
        if refusal is not None:  # the census's input did not matter: apply refuses the family whatever it is fed
            rec["note"] = f"the unpatched model fails on the census's input ({ref['failure']['last_line'][:200]})"
        return dict(rec, outcome=outcome, error=why, seconds=round(time.time() - t0, 2))
    if not census_sweep.finite(ref["out"], None):
        why = dict(
            stage="reference", type="NonFinite", refusal=False, last_line="the unpatched model's logits are not finite"
        )
        return dict(rec, outcome="skipped", error=why, seconds=round(time.time() - t0, 2))
    dtype = ref["dtype"]
    rec.update(dtype=str(dtype).split(".")[-1], reference_attn=ref["attn"])
    if ref["note"]:
        rec["note"], more = ref["note"], None
    # the registry is keyed by the built model's config.model_type (gpt-sw3 builds a 'gpt2' config)
    key = ref["model"].config.model_type
    known = patches.REGISTRY.get(key)
    added = known is None
    if added:  # not verified by an earlier census run, nor registered: opted in by hand, as a user would
        patches.register(patches.FamilyPatch(key, "census", reference_attn=ref["attn"]))
    rec.update(config_model_type=key, registered_by_census=added, verified_by_census=bool(known and known.census))
    # the census's own tolerance: a hand entry's (a family's particular), else the oracle's fixed one; a
    # census-verified family's bound is measured again below, not read back from the list it generates
    hand = known is not None and not known.census
    tol = known.fp64_tolerance if hand and dtype == torch.float64 else FLOAT_TOL[dtype]
    rec["tolerance"] = tol
    model, stage, steps = ref["model"], "apply", []
    pristine = copy.deepcopy(model)
    try:
        hf_contextpar.apply_context_parallel(model, strategy=strategy, timeout=TIMEOUT_S)
        stage = "first forward"
        with torch.no_grad():
            model(ids)
        stage = "run"
        rec.update(compare(ref["out"], conversation(model, ids, more, steps), tol))
        exact = rec["max_diff"] <= tol and (rec["tokens_equal"] or rec["near_tie"])
        rec["outcome"] = "exact" if exact else "differs"
        fp32_sized = rec["tokens_equal"] and FLOAT_TOL[torch.float64] < rec["max_diff"] <= FP32_NOISE
        if dtype == torch.float64 and (tol > FLOAT_TOL[dtype] or (not exact and fp32_sized)):
            stage = "fp32-internals measurement"
            m = census_sweep.fp32_internals(
                pristine, ids, more, ref["out"], conversation, strategy, dist.get_world_size()
            )
            rec["fp32_internal"] = m
            if not exact and census_sweep.fp32_bound_holds(m, rec["max_diff"]):
                rec.update(outcome="exact", tolerance=m["bound"])
                rec["note"] = (
                    f"exact within the model's own fp32 bound {m['bound']:.0e}: its fp32 internals alone move the "
                    f"unpatched model by {m['model_fp32_error']:.1e}; with them in fp64 ours is within "
                    f"{m['ours_with_fp64_internals']:.1e} (prefix alone vs whole forward: {m['prefix_noise']:.1e})"
                )
    except Exception as e:
        rec["error"] = error_record(e, stage if stage != "run" else steps[-1])
        late = stage not in ("apply", "first forward")  # a refusal after the first forward went through: a crash
        rec["outcome"] = "refused" if rec["error"]["refusal"] and not late else "crash"
        if rec["outcome"] == "refused":  # its message says it all
            del rec["error"]["traceback"]
    finally:
        _undo(model, key, added)
    rec["seconds"] = round(time.time() - t0, 2)
    return rec


def _class_name(model_type: str) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, "?")


def agree(records: list[dict]) -> dict:
    """One record from every rank's: the first rank's, or a crash where the ranks disagree."""
    rec = dict(records[0])
    keys = ("outcome", "tokens_equal", "near_tie")
    if any(tuple(r.get(k) for k in keys) != tuple(rec.get(k) for k in keys) for r in records):
        outcomes = [r["outcome"] + (f" ({r['error']['last_line']})" if "error" in r else "") for r in records]
        rec["disagreement"] = outcomes
        rec["outcome"] = "crash"
        rec.setdefault("error", next((r["error"] for r in records if "error" in r), None))
    elif rec["outcome"] == "refused" and len({r["error"]["type"] for r in records}) > 1:
        rec["outcome"] = "crash"
        rec["disagreement"] = [r["error"]["last_line"] for r in records]
    if "max_diff" in rec:
        rec["max_diff"] = max(r.get("max_diff", 0.0) for r in records)
    return rec


def source() -> str | None:
    """The git commit the library runs from, with '+modified' where its files differ from it (None: no git)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(hf_contextpar.__file__)))
    try:
        run = dict(cwd=root, capture_output=True, text=True, check=True, timeout=30)
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], **run).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "-uno", "--", "hf_contextpar", "patches", "eval"], **run
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+modified" if dirty.stdout.strip() else "")


def write(report, args):
    if args.json:  # whole or not at all: a launch that dies mid-write leaves the last report
        with open(args.json + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
        os.replace(args.json + ".tmp", args.json)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(census_report.markdown(report))
    if getattr(args, "verified", None):
        with open(args.verified, "w") as f:
            f.write(census_report.verified_module(report))
    if getattr(args, "readme", None):
        census_report.update_readme(report, args.readme)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", help="comma-separated model types (default: every family in scope)")
    p.add_argument("--strategy", default="auto")
    p.add_argument("--json")
    p.add_argument("--markdown")
    p.add_argument("--resume", action="store_true", help="keep the families --json holds already, run the rest")
    p.add_argument("--from-json", help="only write --markdown / --verified / --readme from this report")
    p.add_argument("--sweep", action="store_true", help="run every strategy, decode mode and a padded batch at this N")
    p.add_argument("--base", help="--sweep: the census report with each family's outcome (default: --json)")
    p.add_argument("--died", help="--sweep --resume: why the last launch died (its log's last error line)")
    p.add_argument("--verified", help="write the verified families' module (patches/verified.py)")
    p.add_argument("--readme", help="update the generated supported-models block of this README")
    p.add_argument("--source", help="what the library is, for the report (default: its git commit)")
    p.add_argument("--list", action="store_true", help="print the families in scope and those dropped")
    args = p.parse_args(argv)
    families, dropped = scope()
    if args.list:
        print("\n".join(families))
        print("\n".join(f"# dropped {mt}: {why}" for mt, why in dropped.items()))
        return
    if args.from_json:
        with open(args.from_json) as f:
            report = json.load(f)
        write(report, argparse.Namespace(json=None, markdown=args.markdown, verified=args.verified, readme=args.readme))
        return
    import transformers

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # generate's past_key_values -> cache
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=4 * TIMEOUT_S))
    rank = dist.get_rank()
    wanted = args.families.split(",") if args.families else families
    unknown = sorted(set(wanted) - set(families))
    if unknown:
        raise SystemExit(f"not in the census's scope: {unknown} (see --list)")
    if args.sweep:
        return census_sweep.main(args, None if args.families else families, sys.modules[__name__])
    report = dict(
        transformers=transformers.__version__,
        torch=torch.__version__.split("+")[0],
        world_size=dist.get_world_size(),
        strategy=args.strategy,
        date=datetime.date.today().isoformat(),
        source=args.source or source(),
        excluded=dropped,
        families=[],
    )
    if args.json and os.path.exists(args.json):
        with open(args.json) as f:
            old = json.load(f)
        if old.get("sweep"):  # each world size's sweep keeps its own source and date
            report["sweep"] = old["sweep"]
        if args.resume:
            report["families"] = [r for r in old["families"] if r["family"] in families]
    done = {r["family"] for r in report["families"]}
    for mt in wanted:
        if mt in done:
            continue
        try:
            mine = run_family(mt, args.strategy)
        except Exception as e:  # outside the comparison itself (the census's own bug): recorded, not fatal
            mine = dict(family=mt, outcome="crash", error=error_record(e, "census"))
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        rec = agree(everyone)
        gc.collect()
        if rank == 0:
            err = rec.get("error") or {}
            print(f"[census] {mt}: {rec['outcome']} {err.get('last_line', '')[:160]}", flush=True)
            report["families"] = sorted([*report["families"], rec], key=lambda r: r["family"])
            missing = sorted(set(families) - {r["family"] for r in report["families"]})
            report["partial"] = f"{len(missing)} families not run yet" if missing else None
            write(report, args)
    dist.barrier()
    dist.destroy_process_group()
