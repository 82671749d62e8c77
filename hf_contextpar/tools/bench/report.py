"""The benchmark's report: our acceptance targets, the markdown table and the plots."""

from __future__ import annotations

import os

PLOTS_EXTRA = 'pip install "hf-contextpar[bench]"'


def check_targets(report) -> list[dict]:
    """The issue's targets, evaluated on the largest measured length of each run."""
    out = []
    for n_key, info in report["runs"].items():
        N = int(n_key)
        rows = [r for r in report["rows"] if r["run_N"] == N]
        if not rows:
            continue
        T = max(r["length"] for r in rows)
        at = {r["strategy"]: r for r in rows if r["length"] == T}
        cps = [r for r in rows if r["kind"] == "cp" and r["length"] == T]
        out += _peer_targets(rows, N)
        if N == 1:
            for r in cps:
                dt, di = r.get("speedup_vs_unpatched"), r.get("ttit_ratio_vs_unpatched")
                if dt is None:
                    continue
                ok = abs(1 / dt - 1) <= 0.03 and abs(di - 1) <= 0.03
                out.append(
                    dict(
                        target=f"N=1 patched ({r['strategy']}) vs unpatched within 3% (T={T})",
                        met=ok,
                        figure=f"TTFT x{1 / dt:.3f}, TTIT x{di:.3f}",
                    )
                )
            continue
        for r in cps:
            s = r["strategy"]
            if r.get("speedup_vs_unpatched") is not None:
                ok = r["speedup_vs_unpatched"] >= 1.8 and r.get("speedup_vs_unpatched_all_cores", 1.0) >= 1.0
                out.append(
                    dict(
                        target=f"prefill {s} N={N} T={T}: >=1.8x vs 1-process same threads, >=1x vs all cores",
                        met=ok,
                        figure=f"{r['speedup_vs_unpatched']:.2f}x / "
                        f"{r.get('speedup_vs_unpatched_all_cores', float('nan')):.2f}x "
                        f"(CPU-time speed-up {r['cpu_speedup_vs_unpatched']:.2f}x)",
                    )
                )
                floor, woken = _floors(info, s)
                over = r["decode_overhead_s"]
                out.append(
                    dict(
                        target=f"decode {s} N={N} T={T}: overhead <= 1.1 x floor ({floor * 1e3:.2f} ms)",
                        met=over <= 1.1 * floor,
                        figure=f"overhead {over * 1e3:.2f} ms = {over / floor if floor else float('nan'):.2f} x floor "
                        f"({over / woken if woken else float('nan'):.2f} x the after-compute floor "
                        f"{woken * 1e3:.2f} ms); "
                        f"TTIT(N={N})/TTIT(1) = {r['ttit_ratio_vs_unpatched']:.2f}",
                    )
                )
                out.append(
                    dict(
                        target=f"KV bytes per rank {s} N={N} T={T}: <= single/N + one token per layer",
                        met=r["kv_within_bound"],
                        figure=f"{max(r['kv_bytes_per_rank'])} <= {r['kv_bound_bytes']:.0f}",
                    )
                )
            if info.get("windowed") and r.get("peak_vs_unpatched") is not None:
                # windowed masks are where O(T^2) buffers hide: no strategy may need more than one process
                out.append(
                    dict(
                        target=f"peak memory per rank {s} N={N} T={T} (sliding window): <= unpatched 1 process",
                        met=r["peak_vs_unpatched"] <= 1.0,
                        figure=f"{_mib(max(r['peak_delta_bytes_per_rank'])):.0f} MiB = "
                        f"{r['peak_vs_unpatched']:.2f} x the unpatched process's peak",
                    )
                )
            if s == "ring_pass_kv":
                out.append(
                    dict(
                        target=f"exposed communication ring_pass_kv N={N} T={T} < 10% of TTFT",
                        met=r["comm_wait_frac"] < 0.10,
                        figure=f"{r['comm_wait_frac'] * 100:.1f}%",
                    )
                )
        del at
    return out


def _peer_targets(rows, N) -> list[dict]:
    """Per peer: logits within tolerance at every length; on N > 1, ring_pass_kv no slower at any length."""
    out = []
    for name in sorted({r["strategy"] for r in rows if r["kind"] == "peer" and r["run_N"] == N}):
        rs = sorted((r for r in rows if r["strategy"] == name and r["run_N"] == N), key=lambda r: r["length"])
        out.append(
            dict(
                target=f"peer {name} N={N}: logits within {rs[0]['logits_tolerance']:g} of the unpatched model",
                met=all(r["logits_ok"] for r in rs),
                figure=", ".join(f"T={r['length']} {r['logits_max_abs_diff']:.1e}" for r in rs),
            )
        )
        ratios = [r for r in rs if r.get("ttft_ratio_ours_over_peer") is not None]
        if N > 1 and ratios:
            out.append(
                dict(
                    target=f"{ratios[0]['rival']} no slower than {name} at every length (N={N})",
                    met=all(r["ttft_ratio_ours_over_peer"] <= 1.0 for r in ratios),
                    figure="ours/peer TTFT "
                    + ", ".join(
                        f"T={r['length']} {r['ttft_ratio_ours_over_peer']:.2f} (CPU {r['cpu_ratio_ours_over_peer']:.2f})"
                        for r in ratios
                    ),
                )
            )
    return out


def _ops(per_rank: list[dict]) -> str:
    """'ring_shift 1.2, all_gather 0.4': each operation's wait, the largest over ranks, in ms."""
    ops = sorted({op for d in per_rank for op in d})
    return ", ".join(f"{op} {max(d.get(op, 0.0) for d in per_rank) * 1e3:.1f}" for op in ops) or "-"


def _mib(x):
    return x / 2**20


def _floors(info, strategy: str) -> tuple[float, float]:
    """(floor, after-compute floor) of decode per token for a row: one small all-gather per layer over
    the transport the row's decode used (gloo for '+gloo' rows, else the run's transport)."""
    layers = info["shape"]["layers"]
    if strategy.endswith("+gloo") and "gloo" in info.get("small_collective_by_transport", {}):
        return (
            layers * info["small_collective_by_transport"]["gloo"],
            layers * info["small_collective_after_compute_by_transport"]["gloo"],
        )
    return info["decode_floor_s"], layers * info.get("small_collective_after_compute_s", 0.0)


def _other_transports(info) -> str:
    return "".join(
        f"; {t} {info['small_collective_by_transport'][t] * 1e3:.3f} ms "
        f"({info['small_collective_after_compute_by_transport'][t] * 1e3:.3f} ms after compute)"
        for t in info.get("small_collective_by_transport", {})
        if t != info.get("transport")
    )


def format_report(report) -> str:
    lines = ["# hf-contextpar benchmark", ""]
    for n_key, info in report["runs"].items():
        m = info["machine"]
        lines.append(
            f"- run N={n_key}: model {info['model']} ({info['dtype']}, {info['device']}), threads/rank "
            f"{info['threads_per_rank']} of {info['cores']} cores, repeats {info['repeats']}, decode "
            f"{info['new_tokens']} tokens; C_attn {m['attn_flops'] / 1e9:.2f} GFLOP/s, C_gemm "
            f"{m['gemm_flops'] / 1e9:.2f} GFLOP/s, BW {m['bandwidth'] / 1e9:.3f} GB/s, small collective "
            f"{info['small_collective_s'] * 1e3:.3f} ms ({info.get('small_collective_after_compute_s', 0) * 1e3:.3f} ms "
            f"after compute{_other_transports(info)}) -> decode floor {info['decode_floor_s'] * 1e3:.2f} ms/token"
            f"{' over ' + info['transport'] if info.get('transport') else ''}; "
            f"load {', '.join(f'{x:.2f}' for x in info['load_before'])}"
        )
        for s in info.get("skipped", []):
            lines.append(f"  - skipped {s['strategy']}: {s['reason']}")
    lines += [
        "",
        "| strategy | N | thr | T | TTFT ms | CPU ms | pred ms | speed-up 1p | CPU speed-up | vs all cores | comm wait | "
        "wait by op ms | TTIT ms | TTIT ratio | KV MiB/rank | peak MiB/rank | sent MiB/rank | recv MiB/rank | tokens = |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    for r in report["rows"]:
        name = {"cp": r["strategy"], "peer": f"peer: {r['strategy']}", "csa": "csa (APPROXIMATE)"}.get(
            r["kind"], f"*{r['strategy']}* (run N={r['run_N']})"
        )
        pred = r.get("predicted_ttft_s")
        lines.append(
            f"| {name} | {r['N']} | {r['threads_per_rank']} | {r['length']} | {r['ttft_s'] * 1e3:.1f} | "
            f"{max(r['ttft_cpu_s_per_rank']) * 1e3:.0f} | "
            f"{f(pred and pred * 1e3, '.1f')} | {f(r.get('speedup_vs_unpatched'), '.2f')} | "
            f"{f(r.get('cpu_speedup_vs_unpatched'), '.2f')} | "
            f"{f(r.get('speedup_vs_unpatched_all_cores'), '.2f')} | {r['comm_wait_frac'] * 100:.1f}% | "
            f"{_ops(r['comm_wait_by_op_s_per_rank'])} | "
            f"{f(r['ttit_s'] and r['ttit_s'] * 1e3, '.2f')} | {f(r.get('ttit_ratio_vs_unpatched'), '.2f')} | "
            f"{_mib(max(r['kv_bytes_per_rank'])):.2f} | {_mib(max(r['peak_delta_bytes_per_rank'])):.0f} | "
            f"{_mib(max(r['bytes_sent_per_rank'])):.2f} | {_mib(max(r['bytes_received_per_rank'])):.2f} | "
            f"{f(r.get('tokens_match_unpatched'), '')} |"
        )
    states = [r for r in report["rows"] if max(r.get("state_bytes_per_rank") or [0])]
    if states:  # a model with recurrent layers: their states per rank, and the chain's idle time (state_recv waits)
        lines += [
            "",
            "Recurrent states per rank (whole on every rank; = one process's): "
            + ", ".join(
                f"{r['strategy']} N={r['N']} T={r['length']}: {_mib(max(r['state_bytes_per_rank'])):.3f} MiB"
                f"{'' if r.get('state_matches_unpatched', True) else ' (differs from one process!)'}"
                for r in states
            ),
        ]
    lines += _index_key_lines(report["rows"])
    lines += [
        "",
        "TTFT: slowest rank, median of repeats; CPU: that rank's process CPU time (all its threads). "
        "speed-up 1p: unpatched one process with the run's threads "
        "per process / this TTFT; CPU speed-up: the same ratio of CPU times (blind to other processes' load); "
        "vs all cores: the TTFT ratio against the unpatched process on every core. comm wait: the slowest rank's time "
        "blocked in communication during prefill, share of TTFT. peak: RSS growth over the config (CPU) or "
        "CUDA peak. tokens =: greedy tokens identical to the unpatched run.",
        "",
    ]
    lines += _peer_table(report["rows"])
    lines += _csa_table(report)
    lines += [
        "## Targets",
        "",
    ]
    for t in report.get("targets", []):
        lines.append(f"- {'met' if t['met'] else 'MISSED'}: {t['target']}: {t['figure']}")
    return "\n".join(lines) + "\n"


def _index_key_lines(rows) -> list:
    """Indexed attention (DSA): what the indexer's keys cost in a prefill, beside the attention's own bytes."""
    index = [r for r in rows if max(p.get("index_keys", 0) for p in r.get("bytes_received_by_op_per_rank") or [{}])]
    if not index:
        return []
    parts = []
    for r in index:
        got = max(p.get("index_keys", 0) for p in r["bytes_received_by_op_per_rank"])
        share = got / max(max(r["bytes_received_per_rank"]), 1)
        parts.append(f"{r['strategy']} N={r['N']} T={r['length']}: {_mib(got):.2f} MiB ({share:.0%} of its bytes)")
    return ["", "Indexer keys received per rank in the prefill (DSA, op index_keys): " + ", ".join(parts)]


def _peer_table(rows) -> list[str]:
    peers = [r for r in rows if r["kind"] == "peer"]
    if not peers:
        return []
    lines = [
        "## Peer: PyTorch's ring attention (prefill only)",
        "",
        "| peer | N | T | peer TTFT ms | ours | ours TTFT ms | ours/peer TTFT | ours/peer CPU | peer comm wait | "
        "peer sent MiB/rank | peer peak MiB/rank | max abs logit diff | logits |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in peers:
        has = r.get("ttft_ratio_ours_over_peer") is not None
        lines.append(
            f"| {r['strategy']} | {r['N']} | {r['length']} | {r['ttft_s'] * 1e3:.1f} | {r.get('rival', '-')} | "
            + (
                f"{r['rival_ttft_s'] * 1e3:.1f} | {r['ttft_ratio_ours_over_peer']:.2f} | "
                f"{r['cpu_ratio_ours_over_peer']:.2f} | "
                if has
                else "- | - | - | "
            )
            + f"{r['comm_wait_frac'] * 100:.1f}% | {_mib(max(r['bytes_sent_per_rank'])):.2f} | "
            f"{_mib(max(r['peak_delta_bytes_per_rank'])):.0f} | {r['logits_max_abs_diff']:.1e} | "
            f"{'ok' if r['logits_ok'] else '**FAILED**'} |"
        )
    lines += [
        "",
        "PyTorch's `_templated_ring_attention` (torch.distributed.tensor.experimental) on PyTorch's head-tail "
        "load balancer, run the way its `context_parallel` runs it (KV heads unrepeated, as transformers' SDPA path "
        "passes enable_gqa), prefill only: TTFT is its forward plus the argmax of the last position on the rank "
        "holding it, broadcast. ours/peer: ring_pass_kv's TTFT (CPU time) over the peer's, same run and rounds "
        "(< 1: ours faster). logits: every position against the unpatched model (context_parallel_unshard).",
        "",
    ]
    return lines


def _csa_table(report) -> list[str]:
    """--csa: the approximate rows beside exact ring pass-KV of the same run and rounds, per rank: TTFT and the
    bytes each rank sent in that prefill."""
    rows = [r for r in report["rows"] if r["kind"] == "csa"]
    if not rows:
        return []
    lines = ["## CSA (APPROXIMATE) beside exact ring pass-KV", ""]
    for n_key, info in report["runs"].items():
        if info.get("csa"):
            lines.append(f"- run N={n_key}: {info['csa']}")
    lines += [
        "",
        "| N | T | TTFT ms per rank: ring_pass_kv | CSA | CSA / ring TTFT | sent KiB per rank: ring_pass_kv | CSA "
        "| CSA / ring bytes | tokens = unpatched |",
        "|---:|---:|---|---|---:|---|---|---:|---|",
    ]

    def per_rank(xs, scale, fmt):
        return " / ".join(format(x * scale, fmt) for x in xs)

    for r in rows:
        if r.get("rival_ttft_s_per_rank") is None:
            continue
        lines.append(
            f"| {r['N']} | {r['length']} | {per_rank(r['rival_ttft_s_per_rank'], 1e3, '.1f')} | "
            f"{per_rank(r['ttft_s_per_rank'], 1e3, '.1f')} | {r['ttft_ratio_vs_rival']:.2f} | "
            f"{per_rank(r['rival_bytes_sent_per_rank'], 2**-10, '.0f')} | {per_rank(r['bytes_sent_per_rank'], 2**-10, '.0f')} "
            f"| {r['bytes_ratio_vs_rival']:.2f} | {r.get('tokens_match_unpatched', '-')} |"
        )
    lines += [
        "",
        "CSA drops distant tokens in prefill: its tokens need not equal the unpatched model's, and it has no targets. "
        "TTFT per rank: each rank's median prefill; sent: that rank's bytes in the last timed prefill. Ratios: the "
        "slowest rank's TTFT, and the bytes of all ranks, CSA over ring_pass_kv.",
        "",
    ]
    return lines


def plot(report, out_dir) -> list[str]:
    """ttft.png, speedup.png, kv_memory.png in out_dir; returns their file names."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(f"the benchmark's plots need matplotlib: {PLOTS_EXTRA}") from e

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(pred):
        groups = {}
        for r in report["rows"]:
            if pred(r):
                label = (
                    f"{r['strategy']} N={r['N']}"
                    if r["kind"] in ("cp", "csa")
                    else f"{r['strategy']} ({r['threads_per_rank']} thr)"
                )
                groups.setdefault(label, []).append(r)
        return {k: sorted(v, key=lambda r: r["length"]) for k, v in groups.items()}

    names = []
    for fname, ylabel, value, pred, logy in (
        ("ttft.png", "TTFT (s)", lambda r: r["ttft_s"], lambda r: True, True),
        (
            "speedup.png",
            "speed-up vs unpatched, same threads/process",
            lambda r: r.get("speedup_vs_unpatched"),
            lambda r: r.get("speedup_vs_unpatched") is not None and r["run_N"] > 1,
            False,
        ),
        (
            "kv_memory.png",
            "KV cache per rank (MiB, largest rank)",
            lambda r: _mib(max(r["kv_bytes_per_rank"])),
            lambda r: r["strategy"] != "unpatched_all_cores" and r["kind"] != "peer",  # peers keep no cache
            True,
        ),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, rs in series(pred).items():
            style = "--" if rs[0]["kind"] == "baseline" else "-"
            (line,) = ax.plot([r["length"] for r in rs], [value(r) for r in rs], style, marker="o", label=label)
            x = [r["length"] for r in rs]
            if fname == "ttft.png" and all(r.get("predicted_ttft_s") for r in rs):
                ax.plot(x, [r["predicted_ttft_s"] for r in rs], "x", color=line.get_color(), alpha=0.6)
            if fname == "speedup.png" and rs[0]["kind"] == "cp":
                ax.plot(x, [r["cpu_speedup_vs_unpatched"] for r in rs], ":", color=line.get_color(), alpha=0.7)
        if fname == "speedup.png":
            ax.axhline(1.8, color="grey", lw=0.8, ls=":", label="target 1.8x")
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel(
            "prompt tokens"
            + {"ttft.png": "   (x: cost-model prediction)", "speedup.png": "   (dotted: CPU-time speed-up)"}.get(
                fname, ""
            )
        )
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, fname), dpi=110)
        plt.close(fig)
        names.append(fname)
    return names


def report_markdown(json_path: str) -> str:
    """The markdown report of an existing bench.json, as a run prints it (`--report`)."""
    import json

    with open(json_path, encoding="utf-8") as f:
        return format_report(json.load(f))
