"""`python -m hf_contextpar.eval needlebench`: greedy generation over a length x depth grid of
needle-in-a-haystack prompts, the unpatched model on one process versus the patched model on N."""

from __future__ import annotations

import sys
import time

import torch

from hf_contextpar.models import is_builtin, max_positions

from . import needlebench as nb
from .common import base_summary, finish, ints, run_tolerance, save_references, setup, weights_fingerprint
from .compare import compare_generation
from .harness import load_reference, on_rank0, run_rounds
from .oracle import fingerprint, near_tie


@torch.no_grad()
def greedy(model, ids, max_new_tokens, tok):
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


def needle_spec(text: str | None):
    """--needles: None (one seeded needle per run, NeedleBench's way), "all", or a list of indices."""
    if text is None:
        return None
    return "all" if text.strip() == "all" else ints(text, "needles")


def cmd_needlebench(args) -> int:
    started = time.perf_counter()
    lengths, depths = ints(args.lengths, "lengths"), ints(args.depths, "depths")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if bad := [t for t in tasks if t not in nb.TASKS]:
        raise SystemExit(f"unknown task(s) {bad}; choose from {', '.join(nb.TASKS)}.")
    if bad := [x for x in depths if not 0 <= x <= 100]:
        raise SystemExit(f"depths are percentages of the haystack, 0..100; got {bad}.")
    needles = needle_spec(args.needles)
    d, model, tok = setup(args)
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
        model=args.model,
        dtype=args.dtype,
        max_new_tokens=args.max_new_tokens,
        source=source,
        weights=weights_fingerprint(model),
    )

    def ref_fn(model, case):
        tokens, logits = greedy(model, case["ids"], args.max_new_tokens, tok)
        return dict(prompt_sha=fingerprint(case["ids"]), tokens=tokens, logits=logits)

    if args.save_reference:
        return save_references(args, "needlebench", meta, cases, lambda c: ref_fn(model, c))
    reference = load_reference(args.reference, "needlebench", cases, meta) if args.reference else None
    tol, rule, ks = run_tolerance(args, d, model, cases[0]["ids"], max((c["ids"] for c in cases), key=len))

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
        rec["near_tie"] = near_tie(rec["divergence_margin"], tol)
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
        cp_fn=lambda m, c: greedy(m, c["ids"], args.max_new_tokens, tok),
        compare_fn=compare_fn,
        desc=f"needlebench N={d.world}",
    )
    base = base_summary(args, d, source, rule, ks, warning)
    base.update(
        tasks=tasks,
        lengths=lengths,
        depths=depths,
        max_new_tokens=args.max_new_tokens,
        allow_near_ties=args.allow_near_ties,
    )
    return finish(args, d, "needlebench", records, tol, base, started)
