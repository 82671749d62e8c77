"""The census beyond its first run: every strategy, both decode modes and a padded batch at this world size
(`sweep_family`), and the measurement that tells a model's own fp32 arithmetic from ours (`fp32_internals`).

The sweep re-runs a family the census found exact under each prefill strategy with a single sequence and
replicated decode, under each again with a left-padded batch of N rows and batched pass-Q decode, and a
padded batch with replicated decode: forward, greedy generate and a second turn, against the unpatched
model, each variant exact / refused / crash / differs, or n/a (Ulysses where N does not divide the heads).

Some models compute parts of an fp64 forward in fp32 on purpose (an MoE router's matmul, an eager
attention's softmax): their logits move by ~1e-7..1e-5 when the same tokens are computed in other
shapes, on one process too. `fp32_internals` measures that with `Fp64Internals`, a torch function mode
that keeps those fp32 casts of fp64 tensors in fp64: the model's own fp32 error (the unpatched model as
shipped against itself with its internals in fp64), ours with the model's internals in fp64 (must be
fp64-exact: then what remains is the model's), and the prefix noise (the unpatched model on a prefix
alone against the same rows inside the whole forward). The family's bound: twice the model's own error,
rounded up to a power of ten.
"""

from __future__ import annotations

import copy
import datetime
import gc
import json
import math
import time

import torch
import torch.distributed as dist
from hf_contextpar.eval.oracle import FLOAT_TOL, Fp64Internals, logits_diff

import hf_contextpar
from hf_contextpar.attention.ulysses import check_ulysses
from hf_contextpar.plan.strategies import prefill_names

PREFILL = prefill_names()
PAD_STEP = 5  # row r of the padded batch has r * PAD_STEP pad tokens on its left
FP64_EXACT = FLOAT_TOL[torch.float64]


def variants() -> list[tuple[str, str, str, bool]]:
    """(name, prefill strategy, decode mode, padded batch of N rows?) of every variant the sweep runs."""
    out = [(f"{s}", s, "replicated", False) for s in PREFILL]
    out += [(f"{s}+padded+pass_q_decode", s, "ring_pass_q", True) for s in PREFILL]
    return [*out, ("ring_pass_kv+padded+replicated_decode", "ring_pass_kv", "replicated", True)]


def padded_batch(world: int, prompt: int, second: int, pad_id: int):
    """(ids, more, mask): N left-padded rows of `prompt` columns (row r: r * PAD_STEP pads), seeded."""
    g = torch.Generator().manual_seed(62)
    rows = max(world, 2)
    ids = torch.randint(3, 256, (rows, prompt), generator=g)
    mask = torch.ones(rows, prompt, dtype=torch.long)
    for r in range(rows):
        mask[r, : r * PAD_STEP] = 0
    ids[mask == 0] = pad_id
    return ids, torch.randint(3, 256, (rows, second), generator=g), mask


# -- the model's own fp32 arithmetic ----------------------------------------------------------------
def _max_diff(ref: dict, other: dict, mask=None) -> float:
    keys = [k for k in ref if k.startswith(("forward", "logits")) and k in other]
    return max(logits_diff(other[k], ref[k], mask if k == "forward" else None) for k in keys)


def fp32_internals(model, ids, more, ref_out: dict, conversation, strategy: str, world: int, mask=None, decode="auto"):
    """The model's own fp32 error, ours with its internals in fp64, the prefix noise, and the bound they give
    (`model` unpatched; every rank runs this, it applies context parallelism once; `mask`: a padded batch's)."""
    pristine = copy.deepcopy(model)
    with Fp64Internals():
        ref64 = conversation(copy.deepcopy(pristine), ids, more, [], mask)
    own = _max_diff(ref64, ref_out, mask)
    cp = copy.deepcopy(pristine)
    hf_contextpar.apply_context_parallel(cp, strategy=strategy, decode=decode)
    try:
        with Fp64Internals():
            ours64 = conversation(cp, ids, more, [], mask)
    finally:
        hf_contextpar.remove_context_parallel(cp)
    prefix = 0.0
    with torch.no_grad():
        whole = pristine(ids).logits if mask is None else None
        for k in sorted({ids.shape[1] * r // n for n in (2, 3, 4) for r in range(1, n)}) if mask is None else ():
            prefix = max(prefix, logits_diff(pristine(ids[:, :k]).logits, whole[:, :k]))
    tokens = all(torch.equal(ours64[k], ref64[k]) for k in ref64 if k.startswith("tokens"))
    bound = 10.0 ** math.ceil(math.log10(2 * own)) if own > 0 else FP64_EXACT
    return dict(
        model_fp32_error=own,
        ours_with_fp64_internals=_max_diff(ref64, ours64, mask),
        tokens_equal_with_fp64_internals=tokens,
        prefix_noise=prefix,
        bound=max(bound, FP64_EXACT),
    )


def fp32_bound_holds(m: dict, max_diff: float) -> bool:
    """Is a difference the model's: ours fp64-exact once the model's internals are fp64, and within the bound?"""
    return (
        m["ours_with_fp64_internals"] <= FP64_EXACT and m["tokens_equal_with_fp64_internals"] and max_diff <= m["bound"]
    )


# -- the sweep ----------------------------------------------------------------------------------------
def run_variant(model, ref_out, inputs, strategy, decode, tol, world, census, fp64: bool) -> dict:
    """One variant on an unpatched model (left unpatched): outcome, max diff or the error."""
    ids, more, mask = inputs
    if strategy == "ulysses":
        try:
            check_ulysses(model.config, world)
        except hf_contextpar.ContextParallelError as e:
            return dict(outcome="n/a", why=type(e).__name__)
    steps, stage = [], "apply"
    try:
        hf_contextpar.apply_context_parallel(model, strategy=strategy, decode=decode, timeout=census.TIMEOUT_S)
        stage = "run"
        rec = census.compare(ref_out, census.conversation(model, ids, more, steps, mask), tol, mask)
        exact = rec["max_diff"] <= tol and (rec["tokens_equal"] or rec["near_tie"])
        rec["outcome"] = "exact" if exact else "differs"
        if not exact and fp64 and rec["tokens_equal"] and FP64_EXACT < rec["max_diff"] <= census.FP32_NOISE:
            hf_contextpar.remove_context_parallel(model)
            stage = "fp32-internals measurement"
            m = fp32_internals(model, ids, more, ref_out, census.conversation, strategy, world, mask, decode)
            rec["fp32_internal"] = m
            if fp32_bound_holds(m, rec["max_diff"]):  # the model's own: within its bound, ours fp64-exact
                rec.update(outcome="exact", tolerance=m["bound"])
    except Exception as e:
        err = census.error_record(e, steps[-1] if steps else stage)
        refused = err["refusal"] and (stage == "apply" or (stage == "run" and steps[-1:] == ["forward"]))
        rec = dict(outcome="refused" if refused else "crash", error=err["last_line"][:300], stage=err["stage"])
        if not refused:
            rec["where"] = err.get("where")
    finally:
        try:
            hf_contextpar.remove_context_parallel(model)
        except Exception:
            pass
    return rec


def sweep_family(model_type: str, base: dict, world: int, census, known=None, starting=None) -> dict:
    """This rank's variants of one family the census found exact (`base`: its census record); `known`: variants
    recorded already (one that killed an earlier launch), `starting(name)` is called before each variant."""
    from hf_contextpar import patches

    t0 = time.time()
    g = torch.Generator().manual_seed(61)
    ids = torch.randint(3, 256, (1, census.PROMPT), generator=g)
    more = torch.randint(3, 256, (1, census.SECOND_TURN), generator=g)
    ref = census.reference(model_type, ids, more)
    if "failure" in ref:
        return dict(outcome="skipped", error=ref["failure"]["last_line"])
    more = None if ref["note"] else more
    model = ref["model"]
    key = model.config.model_type
    added = key not in patches.REGISTRY
    if added:
        patches.register(
            patches.FamilyPatch(key, "census", reference_attn=ref["attn"], fp64_tolerance=base["tolerance"])
        )
    tol = base["tolerance"] if ref["dtype"] == torch.float64 else FLOAT_TOL[ref["dtype"]]
    pad_id = getattr(model.config.get_text_config(decoder=True), "pad_token_id", None) or 0
    fp64 = ref["dtype"] == torch.float64
    pids, pmore, pmask = padded_batch(world, census.PROMPT, census.SECOND_TURN, pad_id)
    pmore = None if ref["note"] else pmore
    out, by_row = {}, False
    try:
        try:
            padded_ref = census.conversation(copy.deepcopy(model), pids, pmore, [], pmask)
            if not finite(padded_ref, pmask):  # its own padded run is broken: each row alone, unpadded, instead
                padded_ref = per_row_reference(model, census, pids, pmore, pmask)
                by_row = True
                if not finite(padded_ref, pmask):
                    padded_ref = "the unpatched model gives non-finite logits on a padded batch and on its rows alone"
        except Exception as e:  # the unpatched model fails on a padded batch: its padded variants are skipped
            padded_ref = census.error_record(e, "reference (padded batch)")["last_line"][:300]
        for name, strategy, decode, padded in variants():
            if name in (known or {}):
                out[name] = known[name]
                continue
            if starting is not None:
                starting(name)
            if padded and isinstance(padded_ref, str):
                out[name] = dict(outcome="skipped", error=padded_ref)
                continue
            inputs = (pids, pmore, pmask) if padded else (ids, more, None)
            r_out = padded_ref if padded else ref["out"]
            out[name] = run_variant(model, r_out, inputs, strategy, decode, tol, world, census, fp64)
            if padded and by_row and out[name]["outcome"] != "n/a":
                out[name]["reference"] = "each row alone, unpadded (the unpatched padded run is not finite)"
    finally:
        if added:
            patches.REGISTRY.pop(key, None)
    return dict(variants=out, tolerance=tol, seconds=round(time.time() - t0, 2))


def per_row_reference(model, census, ids, more, mask) -> dict:
    """A padded batch's reference from each row run alone without its padding, laid out as the batch's (the
    forward's padded positions zero: they are not compared). Each row gets an explicit all-ones mask, as the
    batch's rows do: without one, generate() infers a mask from pad_token_id and a generated token that happens
    to be the pad id is masked in the second turn (granitemoe_swa's row 3 at N = 4 generated id 0: its
    reference was 4.07 from the unpatched model's own forward of the same tokens, ours 5e-6)."""
    rows = []
    for r in range(ids.shape[0]):
        row = ids[r : r + 1, mask[r].bool()]
        rows.append(
            census.conversation(
                copy.deepcopy(model), row, None if more is None else more[r : r + 1], [], torch.ones_like(row)
            )
        )
    forward = rows[0]["forward"].new_zeros(ids.shape[0], ids.shape[1], rows[0]["forward"].shape[-1])
    for r, row in enumerate(rows):
        forward[r, mask[r].bool()] = row["forward"][0]
    out = dict(forward=forward)
    for key in rows[0]:
        if key.startswith("tokens"):
            out[key] = torch.stack([torch.cat([ids[r, ~mask[r].bool()], row[key][0]]) for r, row in enumerate(rows)])
        elif key.startswith("logits"):
            out[key] = torch.cat([row[key] for row in rows])
    return out


def finite(out: dict, mask) -> bool:
    """Are the reference's logits finite (the forward's at real positions)?"""
    forward = out["forward"][mask.bool()] if mask is not None else out["forward"]
    rest = [v for k, v in out.items() if k.startswith("logits")]
    return all(bool(torch.isfinite(t).all()) for t in (forward, *rest))


def agree_sweep(records: list[dict]) -> dict:
    """One family's sweep from every rank's: the first rank's, a variant a crash where ranks disagree."""
    rec = copy.deepcopy(records[0])
    for name, v in rec.get("variants", {}).items():
        others = [r.get("variants", {}).get(name, {}) for r in records]
        if len({o.get("outcome") for o in others}) > 1:
            v.update(outcome="crash", disagreement=[o.get("outcome") for o in others])
        if "max_diff" in v:
            v["max_diff"] = max(o.get("max_diff", 0.0) for o in others)
    return rec


def main(args, everything, census):
    """--sweep: each family given (default: each the base report finds exact) at this world size."""
    with open(args.base or args.json) as f:
        report = json.load(f)
    base = {r["family"]: r for r in report["families"]}
    wanted = [f for f, r in base.items() if r["outcome"] == "exact"] if everything else args.families.split(",")
    if set(wanted) - set(base):
        raise SystemExit(f"--sweep: {sorted(set(wanted) - set(base))} not in the census report (run the census first)")
    world, rank = dist.get_world_size(), dist.get_rank()
    old = report.get("sweep", {}).get(str(world)) if args.resume else None
    old_running = (old or {}).get("running")
    names = [v[0] for v in variants()]
    done = old or dict(source=args.source or census.source(), date=datetime.date.today().isoformat(), families={})
    done["variants"] = names
    source = args.source or census.source()
    report.setdefault("sweep", {})[str(world)] = done
    died = done.setdefault("died", {})  # variants that killed a launch, by family, until the family is done
    if done.pop("running", None) and old_running:  # the last launch died inside this variant: no Python exception
        mt, name = old_running
        why = args.died or "the launch's processes died in this variant with no Python exception (see its log)"
        died.setdefault(mt, {})[name] = dict(outcome="crash", error=f"the launch died: {why}"[:300], stage="launch")

    def starting(mt, name):
        if rank == 0:
            done["running"] = [mt, name]
            census.write(report, args)

    for mt in wanted:
        if mt in done["families"]:
            continue
        try:
            mine = sweep_family(mt, base[mt], world, census, died.get(mt), lambda name, mt=mt: starting(mt, name))
        except Exception as e:  # the census's own bug: recorded, not fatal
            mine = dict(outcome="crash", error=census.error_record(e, "sweep")["last_line"])
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        rec = agree_sweep(everyone)
        gc.collect()
        if rank == 0:
            bad = {n: v["outcome"] for n, v in rec.get("variants", {}).items() if v["outcome"] not in ("exact", "n/a")}
            print(
                f"[sweep N={world}] {mt}: {rec.get('outcome') or bad or 'exact'} ({rec.get('seconds')} s)", flush=True
            )
            if source != done["source"]:  # a family re-run into an earlier sweep: the library it ran with
                rec["source"] = source
            done["families"][mt] = rec
            done.pop("running", None)
            died.pop(mt, None)
            census.write(report, args)
    if not died:
        done.pop("died", None)
        if rank == 0:
            census.write(report, args)
    dist.barrier()
    dist.destroy_process_group()
