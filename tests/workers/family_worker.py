"""One rank of the verified-family check (issue 57): every family of `patches.verified.VERIFIED`, with no opt-in,
against the unpatched model on one process. Writes OUT/rank{r}.json, one record per family (the ranks' agreed one).

    torchrun --nproc_per_node 2 tests/workers/family_worker.py OUT [family,family,...]   (tests: launch.launch(2, ...))
    HF_CONTEXTPAR_FAMILIES=a,b picks families where argv does not (default: every verified family)

Each family is the model census's (dev/census) check, made cheap enough to run for every family in every CI run:
its tiny config (`configs.build`, in the dtype `docs/census.json` ran it in, against the reference attention
VERIFIED names), `run.conversation` (a forward, a short greedy generate, a second turn over the returned cache; a
family the census ran without a second turn, because the unpatched model fails there, keeps it that way) and
`run.compare` (the oracle's tolerance and near-tie rule) within the committed tolerance, VERIFIED's: the census's
fp32-internals measurement, which set those tolerances, is not repeated. What is cheaper than the census:

- a shorter prompt and generate (PROMPT, NEW_TOKENS, SECOND_TURN: still split unevenly across 2 ranks, longer
  than the census configs' 24-token windows and DSA's 16-key top-k, so that both bite in prefill);
- each unpatched reference runs once, on one rank, and its outputs travel to the others: the families go in
  groups of N, rank r running the reference of the group's r-th family, so the N references of a group run side
  by side (on CI's 2 cores, the reference costs half its time) before the group's context-parallel runs;
- the patched model is the reference rank's pristine deep copy, or elsewhere a fresh seeded build (the same
  weights: `configs.build` seeds).

A family that fails does not stop the others: every rank catches its error and records it, the library's
per-model group times out a rank left waiting by a peer that failed (`timeout=`), and the ranks' records are
agreed after each family (`run.agree`: ranks that disagree make a crash).

HF_CONTEXTPAR_FAMILY_BREAK=family[:mode],... (the test that the check can fail): for those families only, the
library's attention function is wrapped before `apply_context_parallel` registers it, and unwrapped after: "perturb"
(the default) moves the last rank's attention output by a relative 1e-6, "raise" raises on every rank. Real faults
inside the launched processes, which the check must report for those families, and for no other.
"""

from __future__ import annotations

import copy
import datetime
import gc
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # dev.census from the checkout
    sys.path.insert(0, ROOT)
from hf_contextpar.patches.verified import VERIFIED  # noqa: E402
from records import write_records  # noqa: E402

import hf_contextpar  # noqa: E402
import hf_contextpar.attention as cp_attention  # noqa: E402
from dev.census import run as census_run  # noqa: E402
from dev.census.configs import build  # noqa: E402
from dev.census.sweep import finite  # noqa: E402

CENSUS = os.path.join(ROOT, "docs", "census.json")
PROMPT, NEW_TOKENS, SECOND_TURN = 31, 4, 5  # the census's: 61, 8, 7
TIMEOUT_S = census_run.TIMEOUT_S  # what a rank waits for its peers inside one family's patched run
# the families left once this much has gone are recorded as not run: many one-rank crashes (a wait of TIMEOUT_S each)
# end in a report naming every family, not in the launcher's kill (tests/launch.py run_matrix: 1200 s)
BUDGET_S = 600.0
BREAK = "HF_CONTEXTPAR_FAMILY_BREAK"
NO_SECOND_TURN = "second turn not compared"  # the census's note where the unpatched model fails there


def families() -> list[dict]:
    """The census's record of every family VERIFIED lists (by its config's model type: gpt-sw3 builds 'gpt2'), with
    the tolerance and reference attention VERIFIED gives it, in the census's order."""
    with open(CENSUS) as f:
        report = json.load(f)
    out = []
    for r in report["families"]:
        key = r.get("config_model_type") or r["family"]
        if key in VERIFIED:
            tol, attn = VERIFIED[key]
            # VERIFIED's is the fp64 tolerance; a family whose unpatched model fails in fp64 (XGLM) ran in fp32, within
            # the oracle's fp32 tolerance, as the census compared it (run.run_family)
            tol = max(tol, census_run.FLOAT_TOL[getattr(torch, r["dtype"])])
            out.append(dict(family=r["family"], key=key, dtype=r["dtype"], tol=tol, attn=attn, note=r.get("note", "")))
    return out


def inputs():
    g = torch.Generator().manual_seed(61)
    return torch.randint(3, 256, (1, PROMPT), generator=g), torch.randint(3, 256, (1, SECOND_TURN), generator=g)


def reference(fam: dict) -> dict:
    """The unpatched model on this process: its outputs, and a pristine copy for this rank's patched run."""
    t0, steps = time.time(), []
    ids, more = inputs()
    try:
        model = build(fam["family"], getattr(torch, fam["dtype"]), fam["attn"])
        pristine = copy.deepcopy(model)
        out = census_run.conversation(model, ids, None if NO_SECOND_TURN in fam["note"] else more, steps)
        if not finite(out, None):
            raise FloatingPointError("the unpatched model's logits are not finite")
    except Exception as e:
        return dict(error=census_run.error_record(e, f"reference {steps[-1] if steps else 'build'}"))
    return dict(out=out, seconds=round(time.time() - t0, 2), pristine=pristine)


def broken(attend, mode: str):
    """The library's attention function with a deliberate fault: "perturb", its output moved by a relative 1e-6 on
    the last rank; "raise", an error on every rank (at the same layer: nobody is left waiting)."""

    def attend_broken(*args, **kwargs):
        out, weights = attend(*args, **kwargs)  # first: the library tells a layer that never reached it apart
        if mode == "raise":
            raise RuntimeError(f"{BREAK}: a deliberate fault")
        return (out * (1 + 1e-6) if dist.get_rank() == dist.get_world_size() - 1 else out), weights

    return attend_broken


def breaks() -> dict[str, str]:
    """HF_CONTEXTPAR_FAMILY_BREAK=family[:mode],...: {family: "perturb" or "raise"}."""
    entries = [e.split(":") for e in os.environ.get(BREAK, "").split(",") if e]
    return {e[0]: e[1] if len(e) > 1 else "perturb" for e in entries}


def patched_run(fam: dict, ref: dict, model) -> dict:
    """This rank's outcome for one family: apply with no opt-in, the conversation, the oracle's verdict."""
    t0, stage, steps = time.time(), "build", []
    rec = dict(family=fam["family"], tolerance=fam["tol"], reference_seconds=ref.get("seconds"))
    if "error" in ref:
        return dict(rec, outcome="reference failed", error=ref["error"])
    ids, more = inputs()
    original = cp_attention.context_parallel_attention
    if fam["family"] in breaks():  # registered by apply_context_parallel below
        cp_attention.context_parallel_attention = broken(original, breaks()[fam["family"]])
    try:
        model = model if model is not None else build(fam["family"], getattr(torch, fam["dtype"]), fam["attn"])
        stage = "apply"
        hf_contextpar.apply_context_parallel(model, timeout=TIMEOUT_S)
        stage = "run"
        cp = census_run.conversation(model, ids, None if "tokens2" not in ref["out"] else more, steps)
        rec.update(census_run.compare(ref["out"], cp, fam["tol"]))
        exact = rec["max_diff"] <= fam["tol"] and (rec["tokens_equal"] or rec["near_tie"])
        rec["outcome"] = "exact" if exact else "differs"
    except Exception as e:
        rec.update(outcome="crash", error=census_run.error_record(e, steps[-1] if steps else stage))
    finally:
        cp_attention.context_parallel_attention = original
        if model is not None:
            try:
                hf_contextpar.remove_context_parallel(model)
            except Exception:
                pass
    rec["seconds"] = round(time.time() - t0, 2)
    return rec


def agreed(rec: dict, world: int) -> dict:
    """One record from every rank's (`run.agree`), with each rank's error where one failed: the rank that crashed
    first says why, its peers only that it stopped answering."""
    everyone = [None] * world
    dist.all_gather_object(everyone, rec)
    out = census_run.agree(everyone)
    if any("error" in r for r in everyone):
        out["rank_errors"] = [(r.get("error") or {}).get("last_line") for r in everyone]
    return out


def run_group(group: list[dict], rank: int, world: int) -> list[dict]:
    """The group's references side by side (rank r: the r-th family's), shared, then each family's patched run."""
    mine = reference(group[rank]) if rank < len(group) else {}
    pristine = mine.pop("pristine", None)
    shared = [None] * world
    dist.all_gather_object(shared, mine)
    records = []
    for i, fam in enumerate(group):
        records.append(agreed(patched_run(fam, shared[i], pristine if i == rank else None), world))
        if rank == 0:
            err = records[-1].get("error") or {}
            print(f"[families] {fam['family']}: {records[-1]['outcome']} {err.get('last_line', '')[:160]}", flush=True)
    gc.collect()  # the group's models (reference cycles), with nothing frozen to walk
    return records


def spent(t0: float, group: list[dict]) -> list[dict] | None:
    """The group's records as not run where rank 0 says the launch's budget is spent (every rank stops at the same
    family), else None."""
    box = [time.monotonic() - t0 > BUDGET_S]
    dist.broadcast_object_list(box, src=0)
    if not box[0]:
        return None
    why = f"not run: the launch's {BUDGET_S:.0f} s were spent (earlier families' crashes, {TIMEOUT_S:.0f} s each)"
    return [dict(family=f["family"], outcome="not run", error=dict(stage="budget", last_line=why)) for f in group]


def chosen(todo: list[dict]) -> list[dict]:
    """argv[2] or HF_CONTEXTPAR_FAMILIES (comma-separated) of the verified families, else all of them."""
    names = sys.argv[2] if len(sys.argv) > 2 else os.environ.get("HF_CONTEXTPAR_FAMILIES", "")
    if not names:
        return todo
    unknown = sorted(set(names.split(",")) - {f["family"] for f in todo})
    if unknown:
        raise SystemExit(f"not verified families (patches/verified.py by docs/census.json): {unknown}")
    return [f for f in todo if f["family"] in names.split(",")]


def main():
    todo = chosen(families())
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # generate's past_key_values -> cache
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=4 * TIMEOUT_S))
    census_run.NEW_TOKENS = NEW_TOKENS  # conversation's generate length (a module constant of the census)
    rank, world = dist.get_rank(), dist.get_world_size()
    gc.freeze()  # the imports' objects out of every collection: a full one walked them, 0.25 s a family
    records, t0 = [], time.monotonic()
    for start in range(0, len(todo), world):
        group = todo[start : start + world]
        records += spent(t0, group) or run_group(group, rank, world)
    write_records(sys.argv[1], records)


if __name__ == "__main__":
    main()
