"""The benchmark's table rows: one per configuration and length from every rank's samples, annotated
with the cost model's prediction and the comparisons against this run's baselines (and, for the
peer rows, against ours), merged with the rows an earlier run of another world size left in DIR."""

from __future__ import annotations

import json
import os

from ...plan import costmodel
from .report import check_targets

GLOO = "+gloo"  # --gloo-rows: a strategy's row with shared memory off (decode's gathers over gloo)
PEER_RIVAL = "ring_pass_kv"  # the strategy each peer row is compared with (ours/peer)


def make_row(kind, strategy, world, length, threads, per_rank: list[dict]):
    """One table row: scalar timings from rank 0 (identical work on every rank), per-rank lists for the rest."""
    r0 = per_rank[0]
    ttit = [p["ttit_s"] for p in per_rank]  # None for a peer (prefill only)
    row = dict(
        kind=kind,
        strategy=strategy,
        N=world,
        length=length,
        threads_per_rank=threads,
        ttft_s=max(p["ttft_s"] for p in per_rank),
        ttft_all_s=r0["ttft_all_s"],
        ttit_s=None if None in ttit else max(ttit),
        ttit_all_s=r0["ttit_all_s"],
        ttft_s_per_rank=[p["ttft_s"] for p in per_rank],
    )
    for key in (
        "kv_bytes",
        "state_bytes",
        "peak_bytes",
        "peak_delta_bytes",
        "bytes_sent",
        "bytes_received",
        "comm_wait_s",
        "comm_wait_by_op_s",
        "bytes_received_by_op",
        "decode_comm_wait_s",
        "ttft_cpu_s",
    ):
        row[f"{key}_per_rank"] = [p[key] for p in per_rank]
    row["comm_wait_frac"] = max(row["comm_wait_s_per_rank"]) / row["ttft_s"] if row["ttft_s"] > 0 else 0.0
    row["tokens"] = r0["tokens"]
    return row


def annotate(rows, run_info, shape, machine):
    """Predictions, speed-ups against this run's baselines, token agreement, KV bound."""
    base = {(r["strategy"], r["length"]): r for r in rows if r["kind"] == "baseline"}
    ours = {r["length"]: r for r in rows if r["kind"] == "cp" and r["strategy"] == PEER_RIVAL}
    token_bytes = 2 * shape.kv_heads * shape.head_dim * shape.elem_bytes * shape.layers  # one token, every layer
    for r in rows:
        r["run_N"] = run_info["N"]
        r["predicted_ttft_s"] = costmodel.predict_ttft(
            r["strategy"].removesuffix(GLOO) if r["kind"] == "cp" else "unpatched", r["length"], r["N"], shape, machine
        )
        if r["kind"] == "baseline" and r["strategy"] == "unpatched_all_cores":
            r["predicted_ttft_s"] = None  # the machine constants are per rank (run's threads)
        one, allc = base.get(("unpatched", r["length"])), base.get(("unpatched_all_cores", r["length"]))
        if allc is None and run_info["threads_per_rank"] == run_info["cores"]:
            allc = one
        if one is not None:
            r["speedup_vs_unpatched"] = one["ttft_s"] / r["ttft_s"]
            # CPU time is what contention from other processes does not inflate: the efficiency of the work itself
            r["cpu_speedup_vs_unpatched"] = one["ttft_cpu_s_per_rank"][0] / max(r["ttft_cpu_s_per_rank"])
        if r["kind"] == "csa":
            _annotate_csa(r, ours.get(r["length"]))
        if r["kind"] == "peer":
            _annotate_peer(r, one, ours.get(r["length"]))
        elif one is not None:
            r["ttit_ratio_vs_unpatched"] = r["ttit_s"] / one["ttit_s"]
            r["decode_overhead_s"] = r["ttit_s"] - one["ttit_s"]
            r["tokens_match_unpatched"] = r["tokens"] == one["tokens"]
            r["kv_bound_bytes"] = one["kv_bytes_per_rank"][0] / r["N"] + token_bytes
            r["kv_within_bound"] = max(r["kv_bytes_per_rank"]) <= r["kv_bound_bytes"]
            # recurrent layers' states: whole on every rank, as on one process
            r["state_matches_unpatched"] = set(r["state_bytes_per_rank"]) == {one["state_bytes_per_rank"][0]}
            r["peak_vs_unpatched"] = max(r["peak_delta_bytes_per_rank"]) / max(1, one["peak_delta_bytes_per_rank"][0])
        if allc is not None:
            r["speedup_vs_unpatched_all_cores"] = allc["ttft_s"] / r["ttft_s"]


def _annotate_peer(r, one, ours):
    """A peer row: its first token against the unpatched one, and ours/peer (TTFT and CPU time) at its length."""
    if one is not None:
        r["tokens_match_unpatched"] = r["tokens"] == one["tokens"][:1]
        r["peak_vs_unpatched"] = max(r["peak_delta_bytes_per_rank"]) / max(1, one["peak_delta_bytes_per_rank"][0])
    if ours is not None:
        r["rival"] = PEER_RIVAL
        r["rival_ttft_s"] = ours["ttft_s"]
        r["ttft_ratio_ours_over_peer"] = ours["ttft_s"] / r["ttft_s"]
        r["cpu_ratio_ours_over_peer"] = max(ours["ttft_cpu_s_per_rank"]) / max(r["ttft_cpu_s_per_rank"])


def _annotate_csa(r, ours):
    """A CSA row (approximate) beside ring_pass_kv of the same run: each rank's TTFT and bytes sent, and the ratios
    (slowest rank's TTFT, all ranks' bytes). Its tokens are compared with the unpatched model's like every row's,
    but a difference is the approximation, not a failure."""
    r["approximate"] = True
    r["predicted_ttft_s"] = None  # the cost model has no CSA
    if ours is None:
        return
    r["rival"] = PEER_RIVAL
    r["rival_ttft_s_per_rank"] = ours["ttft_s_per_rank"]
    r["rival_bytes_sent_per_rank"] = ours["bytes_sent_per_rank"]
    r["ttft_ratio_vs_rival"] = r["ttft_s"] / ours["ttft_s"]
    r["bytes_ratio_vs_rival"] = sum(r["bytes_sent_per_rank"]) / max(1, sum(ours["bytes_sent_per_rank"]))


def merge(path, run_info, rows):
    """Keep rows (and run info) of other world sizes from an earlier run into the same DIR."""
    runs, kept = {}, []
    if os.path.exists(path):
        try:
            old = json.load(open(path))
            runs = {int(k): v for k, v in old.get("runs", {}).items()}
            kept = [r for r in old.get("rows", []) if r.get("run_N") != run_info["N"]]
        except (OSError, ValueError):
            pass
    runs[run_info["N"]] = run_info
    all_rows = sorted(kept + rows, key=lambda r: (r["run_N"], r["kind"] != "baseline", r["strategy"], r["length"]))
    report = dict(runs={str(k): v for k, v in sorted(runs.items())}, rows=all_rows)
    report["targets"] = check_targets(report)
    return report
