"""`python -m hf_contextpar.eval bookcorpus`: teacher-forced windows of BookCorpus text, every
position's logits of the unpatched model on one process versus the patched model on N."""

from __future__ import annotations

import sys
import time

import torch

from hf_contextpar.models import is_builtin, max_positions

from . import bookcorpus as bc
from .common import base_summary, finish, run_tolerance, save_references, setup, weights_fingerprint
from .compare import window_metrics
from .harness import load_reference, on_rank0, run_rounds
from .oracle import fingerprint


def cmd_bookcorpus(args) -> int:
    started = time.perf_counter()
    if args.window < 2:  # --num-windows is checked while parsing
        raise SystemExit("--window must be at least 2 tokens.")
    d, model, tok = setup(args)
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
    meta = dict(
        model=args.model, dtype=args.dtype, window=args.window, source=source, weights=weights_fingerprint(model)
    )

    @torch.no_grad()
    def forward(model, case):
        x = torch.tensor([case["ids"]], device=d.device)
        return model(x, use_cache=False).logits[0]

    if args.save_reference:
        return save_references(
            args,
            "bookcorpus",
            meta,
            cases,
            lambda c: dict(prompt_sha=fingerprint(c["ids"]), logits=forward(model, c).cpu()),
        )
    reference = load_reference(args.reference, "bookcorpus", cases, meta) if args.reference else None
    tol, rule, ks = run_tolerance(args, d, model, cases[0]["ids"], max((c["ids"] for c in cases), key=len))

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
    base = base_summary(args, d, source, rule, ks, warning)
    base.update(window=args.window, num_windows=args.num_windows)
    return finish(args, d, "bookcorpus", records, tol, base, started)
