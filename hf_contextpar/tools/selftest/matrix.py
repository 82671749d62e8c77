"""The torchrun self-test: a compact exactness matrix against the unpatched model on one process.

Cases, per dtype (float32, bfloat16, float16):
- `greedy/<strategy>`, every prefill strategy: the prompt's logits at every position, then greedy
  generate (batch 1: replicated decode);
- `padded/<decode>`, every decode mode: a left-padded batch of N + 1 prompts (so batched pass-Q
  decode can run), its logits at real positions, then greedy generate;
- `second_turn/<strategy>`: generate, keep the returned cache, append a new message and generate
  again on it (partial prefill over a sharded cache a batched decode filled; batch 2, one row
  left-padded), for ring pass-KV, ring pass-Q and the planner.
A case passes when every rank's logits are within the project's tolerance of the reference
(the exactness oracle, `hf_contextpar.eval.oracle.tolerance`: fp32 1e-4; bf16/fp16 max(1e-2, what
swapping the unpatched model's attention kernel between eager and SDPA changes)), every generated token is
identical, and every rank got bit-identical results. Ulysses where N does not divide the heads
must be refused with UnsupportedModelError (the documented contract), and that counts as a pass.

The reference runs on rank 0 alone (the unpatched model: nothing distributed touches it) and is
broadcast. Keeping ranks in lockstep: every case runs on a fresh process group with a timeout
(`apply_context_parallel(timeout=...)`), errors are caught per case on every rank and outcomes are
exchanged on the default group; if ranks did not all fail alike (one raised, its peers timed out),
their state is no longer trusted and the remaining cases are recorded as not run.

`inject` (the `--inject-fault` glob) perturbs, inside the comparison only, the context-parallel
logits and last token of matching cases: it proves the checker can fail without touching the
library.
"""

from __future__ import annotations

import fnmatch
import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ...cache.sharded import cache_argument, returned_cache

NEW_TOKENS = 6
PROMPT = 37  # not a multiple of 2N for N = 2..5
SECOND_TURN_STRATEGIES = ("ring_pass_kv", "ring_pass_q", "auto")


@dataclass(frozen=True)
class Case:
    dtype: str
    kind: str  # "greedy", "padded", "second_turn"
    strategy: str
    decode: str

    @property
    def name(self) -> str:
        which = self.decode if self.kind == "padded" else self.strategy
        return f"{self.dtype}/{self.kind}/{which}"


def cases_for(dtypes: list[str]) -> list[Case]:
    from ...api import DECODES, STRATEGIES

    out = []
    for dtype in dtypes:
        out += [Case(dtype, "greedy", s, "auto") for s in STRATEGIES]
        out += [Case(dtype, "padded", "auto", d) for d in DECODES]
        out += [Case(dtype, "second_turn", s, "auto") for s in SECOND_TURN_STRATEGIES]
    return out


# -- inputs and one run of a case's workload ----------------------------------------------------
def inputs_for(kind: str, world: int, vocab: int, device) -> dict:
    """Token ids and masks of a workload; the same on every rank (seeded) and for every strategy."""
    g = torch.Generator().manual_seed({"greedy": 1, "padded": 2, "second_turn": 3}[kind])
    high = min(vocab, 256)

    def rand(*shape):
        return torch.randint(0, high, shape, generator=g)

    if kind == "greedy":
        ids = rand(1, PROMPT)
        inputs = dict(ids=ids, mask=torch.ones_like(ids))
    elif kind == "padded":
        lengths = [PROMPT - 9 * (i % 3) - i for i in range(world + 1)]
        ids, mask = torch.zeros(len(lengths), PROMPT, dtype=torch.long), torch.zeros(len(lengths), PROMPT)
        for i, n in enumerate(lengths):
            ids[i, PROMPT - n :], mask[i, PROMPT - n :] = rand(n), 1
        inputs = dict(ids=ids, mask=mask.long())
    else:
        ids = rand(2, PROMPT)
        mask = torch.ones_like(ids)
        mask[1, :11] = 0
        inputs = dict(ids=ids, mask=mask, follow_up=rand(2, 2 * world + 3))
    return {k: v.to(device) for k, v in inputs.items()}


@torch.no_grad()
def run_workload(model, kind: str, inputs: dict) -> dict:
    """Logits of the prompt (with its mask), then greedy generation: {logits, masks, tokens, steps}, on CPU."""

    def generate(ids, mask, **kw):
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            **kw,
        )
        return out, torch.stack(out.logits, 1)

    ids, mask = inputs["ids"], inputs["mask"]
    res = dict(logits=[model(ids, attention_mask=mask).logits], masks=[mask], tokens=[], steps=[])
    out, steps = generate(ids, mask)
    res["tokens"].append(out.sequences)
    res["steps"].append(steps)
    if kind == "second_turn":
        follow = inputs["follow_up"]
        ids2 = torch.cat([out.sequences, follow], 1)
        mask2 = torch.cat(
            [mask, torch.ones(ids2.shape[0], ids2.shape[1] - mask.shape[1], dtype=mask.dtype, device=mask.device)], 1
        )
        out2, steps2 = generate(ids2, mask2, **{cache_argument(model): returned_cache(out)})
        res["tokens"].append(out2.sequences)
        res["steps"].append(steps2)
    return {k: [t.detach().cpu() for t in v] for k, v in res.items()}


# -- comparison ---------------------------------------------------------------------------------
def compare(kind: str, ref: dict, mine: dict, tol: float) -> tuple[bool, float, str]:
    """(passed, max |logit diff|, detail) of one rank's results against the reference.

    Logits: the prompt's at real positions, and every generated step's up to the first token that
    differs (after it the two runs condition on different text). Tokens: identical, except at a
    near-tie (`oracle.near_tie`: the reference's top-2 margin at most twice the tolerance; what the
    fuzz test and the eval harness's --allow-near-ties accept): in bf16 a kernel swap alone flips
    those. A later turn after a near-tie starts from different text and is not compared.
    """
    from ...eval.oracle import first_divergence, logits_diff, near_tie, top2_margin

    def diff(a, b, mask=None):
        d = logits_diff(a.float(), b.float(), mask)
        return d if not math.isnan(d) else math.inf

    worst, problems, notes = 0.0, [], []
    for a, b, m in zip(mine["logits"], ref["logits"], ref["masks"]):
        d = diff(a, b, m)
        worst = max(worst, d)
        if not d <= tol:
            problems.append(f"prompt logits differ by {d:.3g} > {tol:.3g}")
    for turn, (ta, tb, sa, sb) in enumerate(zip(mine["tokens"], ref["tokens"], mine["steps"], ref["steps"])):
        where = f"turn {turn + 1}: " if kind == "second_turn" else ""
        if ta.shape != tb.shape or sa.shape != sb.shape:
            problems.append(f"{where}shapes differ: {tuple(ta.shape)} vs {tuple(tb.shape)}")
            break
        prompt = tb.shape[1] - sb.shape[1]
        div = first_divergence(ta, tb)
        step = sb.shape[1] - 1 if div is None else div - prompt  # the last step both runs share a prefix for
        if step < 0:
            problems.append(f"{where}the prompt differs at position {div}")
            break
        d = diff(sa[:, : step + 1], sb[:, : step + 1])
        worst = max(worst, d)
        if not d <= tol:
            problems.append(f"{where}generated-step logits differ by {d:.3g} > {tol:.3g}")
        if div is None:
            continue
        row = int((ta[:, div] != tb[:, div]).nonzero()[0])
        margin = top2_margin(sb[row, step])
        if near_tie(margin, tol):
            notes.append(f"{where}near-tie at new token {step} (row {row}, reference margin {margin:.3g})")
            break
        problems.append(f"{where}tokens differ at new token {step} (row {row}, reference margin {margin:.3g})")
    return not problems, worst, "; ".join(problems or notes)


def perturbed(res: dict, tol: float) -> dict:
    """--inject-fault: the results with a known error, for the checker only (proves it can fail)."""
    tokens = res["tokens"][0].clone()
    tokens[:, -1] = (tokens[:, -1] + 1) % res["steps"][0].shape[-1]
    return dict(
        res, logits=[res["logits"][0] + 10 * tol + 1.0, *res["logits"][1:]], tokens=[tokens, *res["tokens"][1:]]
    )


def digest(res: dict) -> str:
    from ...eval.oracle import digest as tensors_digest

    return tensors_digest(t for key in ("logits", "tokens", "steps") for t in res[key])


# -- the run ------------------------------------------------------------------------------------
KINDS = ("greedy", "padded", "second_turn")


def _kernel_swap(model, kind, inputs, ref) -> float | None:
    """Max |logit diff| between the unpatched model's attention kernel and the other of eager/SDPA
    on this workload (as eval.oracle.kernel_swap, over the whole workload): the low-precision bound."""
    from ...eval.oracle import other_attention_kernel

    with other_attention_kernel(model) as swapped:
        if not swapped:
            return None
        other = run_workload(model, kind, inputs)
    return compare(kind, ref, other, math.inf)[1]


def _reference(model, dtype, world, vocab, device):
    """On rank 0: every kind's reference results, and the logit tolerance (eval.oracle.tolerance:
    fp32 1e-4; bf16/fp16 max(1e-2, the largest kernel swap over the workloads): a property of the
    model in this dtype, so one workload's luckier draw does not set it)."""
    from ...eval.oracle import tolerance

    refs, swaps = {}, {}
    for kind in KINDS:
        inputs = inputs_for(kind, world, vocab, device)
        refs[kind] = run_workload(model, kind, inputs)
        if dtype not in (torch.float32, torch.float64):
            swaps[kind] = _kernel_swap(model, kind, inputs, refs[kind])
    measured = [s for s in swaps.values() if s is not None]
    tol, rule = tolerance(dtype, model.config.model_type, max(measured) if measured else None)
    return dict(refs=refs, tol=tol, rule=rule, kernel_swap=swaps)


def _broadcast(obj, rank):
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(obj, world):
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _ulysses_fits(model, world) -> bool:
    text = model.config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    return heads % world == 0 and kv % world == 0


def run_case(case, model, ref, world, vocab, device, timeout, inject) -> dict:
    """This rank's outcome of one case: status pass/fail/error, max diff, detail, digest."""
    import hf_contextpar

    t0 = time.perf_counter()
    out = dict(status="error", max_diff=None, detail="", digest=None)
    expect_refusal = case.strategy == "ulysses" and not _ulysses_fits(model, world)
    try:
        hf_contextpar.apply_context_parallel(model, strategy=case.strategy, decode=case.decode, timeout=timeout)
        try:
            mine = run_workload(model, case.kind, inputs_for(case.kind, world, vocab, device))
        finally:
            hf_contextpar.remove_context_parallel(model)
        if expect_refusal:
            out.update(status="fail", detail=f"ulysses ran on N={world}, which does not divide the heads")
        else:
            out["digest"] = digest(mine)
            if inject and fnmatch.fnmatch(case.name, inject):
                mine = perturbed(mine, ref["tol"])
            ok, worst, detail = compare(case.kind, ref["refs"][case.kind], mine, ref["tol"])
            out.update(status="pass" if ok else "fail", max_diff=worst, detail=detail)
    except hf_contextpar.UnsupportedModelError as e:
        if expect_refusal:
            out.update(status="pass", refused=True, detail=f"refused as documented: {str(e)[:120]}...")
        else:
            out.update(detail=f"UnsupportedModelError: {e}")
    except Exception as e:  # noqa: BLE001 - recorded; the ranks compare outcomes next
        out.update(detail=f"{type(e).__name__}: {e}")
    out["seconds"] = time.perf_counter() - t0
    return out


def merge_outcomes(case: Case, outcomes: list[dict], tol: float) -> dict:
    """One record from every rank's outcome: a pass needs every rank to pass with identical results."""
    rec = dict(asdict(case), name=case.name, tolerance=tol, seconds=round(max(o["seconds"] for o in outcomes), 3))
    diffs = [o["max_diff"] for o in outcomes if o["max_diff"] is not None]
    rec["max_diff"] = max(diffs) if diffs else None
    rec["refused"] = all(o.get("refused") for o in outcomes)
    bad = [(r, o) for r, o in enumerate(outcomes) if o["status"] != "pass"]
    if bad:
        status = "error" if any(o["status"] == "error" for _, o in bad) else "fail"
        rec.update(status=status, detail="; ".join(f"rank {r}: {o['detail'][:400]}" for r, o in bad))
    elif len({o["digest"] for o in outcomes}) > 1:
        rec.update(status="fail", detail="ranks returned different results")
    else:
        rec.update(status="pass", detail=outcomes[0]["detail"])
    return rec


def run_matrix(model_name, dtypes, rank, world, device, timeout, inject, log) -> tuple[list[dict], dict, bool]:
    """(records in case order, tolerances per dtype, in_step); identical on every rank."""
    from ...models import DTYPES, load

    cases = cases_for(dtypes)
    if inject and not any(fnmatch.fnmatch(c.name, inject) for c in cases):
        raise SystemExit(
            f"--inject-fault {inject!r} matches no case; the names look like {cases[0].name!r} "
            "(dtype/kind/variant, with the dtype spelt in full)."
        )
    names = _gather([c.name for c in cases], world)
    if any(n != names[0] for n in names):
        raise SystemExit(f"selftest: the ranks built different case lists ({[len(n) for n in names]} cases by rank)")
    records, tolerances, in_step = [], {}, True
    for dname in dtypes:
        mine = [c for c in cases if c.dtype == dname]
        if not in_step:
            records += [_not_run(c, "ranks out of step after an earlier case") for c in mine]
            continue
        dtype = DTYPES[dname]
        try:
            model, loaded = load(model_name, dtype, device)[0], ""
        except (Exception, SystemExit) as e:  # noqa: BLE001 - the ranks agree on it next
            model, loaded = None, f"{type(e).__name__}: {e}"
        failures = [f for f in _gather(loaded, world) if f]
        if failures:  # every rank skips the dtype, so none waits for a peer that has no model
            records += [_not_run(c, f"loading {model_name} in {dname} failed: {failures[0]}") for c in mine]
            continue
        vocab = model.config.get_text_config(decoder=True).vocab_size
        payload = None
        if rank == 0:
            try:
                payload = ("ok", _reference(model, dtype, world, vocab, device))
            except Exception as e:  # noqa: BLE001 - every rank records it
                payload = ("error", f"{type(e).__name__}: {e}")
        status, ref = _broadcast(payload, rank)
        if status != "ok":
            records += [_not_run(c, f"the unpatched reference failed: {ref}") for c in mine]
            continue
        tolerances[dname] = dict(tolerance=ref["tol"], rule=ref["rule"], kernel_swap=ref["kernel_swap"])
        log(f"  {dname}: logit tolerance {ref['tol']:.3g} ({ref['rule']})")
        for case in mine:
            if not in_step:
                records.append(_not_run(case, "ranks out of step after an earlier case"))
                continue
            outcomes = _gather(run_case(case, model, ref, world, vocab, device, timeout, inject), world)
            records.append(merge_outcomes(case, outcomes, ref["tol"]))
            errored = [o["status"] == "error" for o in outcomes]
            if any(errored) and not all(errored):
                in_step = False  # one rank raised while its peers waited: their state is not trusted
        del model
    return records, tolerances, in_step


def _not_run(case: Case, why: str) -> dict:
    return dict(asdict(case), name=case.name, status="not_run", detail=why, max_diff=None, refused=False, seconds=0.0)
