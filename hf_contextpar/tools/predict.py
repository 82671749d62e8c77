"""`python -m hf_contextpar predict`: context parallelism on paper, from the one cost model.

    python -m hf_contextpar predict --model llama-3.1-70b --hardware h100-rdma --tp 8 --world 1,8 \\
        --lengths 131072,1048576 --miss-rates 1,0.1,0.01

For a model (a hub id, a config.json or a model directory, a built-in model, or one of the
published geometries below) on a machine (a preset below, or a calibration JSON from `python -m
hf_contextpar calibrate`), prints per CP world size N, context length and KV-cache miss rate:
each strategy's predicted TTFT (costmodel.predict_ttft), TTIT of the decode that follows (one
token, replicated decode), KV cache and attention traffic per rank, which strategy `auto` picks,
and the miss rate below which pass-Q overtakes pass-KV. `--tp` spreads each CP rank over that many
GPUs (Meta's layout: TP8 inside a node, CP across nodes), each with the heads the model's TP plan
leaves it (`tp_heads`; TP's own communication is not modelled). `--table4` checks the model against
the Meta CP paper's measured partial prefill. Presets use published or measured figures; your own
measured constants (`calibrate`) beat them.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from ..cliargs import fractions, positive_int, positive_ints
from ..plan.choice import choose
from ..plan.costmodel import Shape, kv_bytes_per_rank, predict_ttft, predict_ttit, traffic_per_rank
from ..plan.machine import Machine
from ..plan.strategies import prefill_names
from .layout import format_bytes, format_seconds
from .presets import DTYPE_BYTES, GEOMETRIES, PRESETS, machine_of, shape_of_dtype, tp_replicas

STRATEGIES = prefill_names()


def pass_q_threshold(context: int, N: int, shape: Shape, m: Machine) -> float | None:
    """The largest miss rate T/(T+P) at which the cost model prefers pass-Q (None: never)."""
    best = None
    for i in range(200):  # miss rates 1 .. 1e-5, log-spaced
        rate = 10 ** (-5 * i / 199)
        T = max(1, round(rate * context))
        if choose(T, context - T, N, shape, m, "cost").strategy == "ring_pass_q":
            best = T / context
            break
    return best


# Meta CP paper Table 4: Llama 3 405B (FP8 weights, TP8 per node), 128K context on 4 GTT nodes (RDMA):
# (new tokens T, pass-KV TTFT ms, pass-Q TTFT ms) per KV-cache miss rate T / 128000.
TABLE4 = (
    (1280, 1023.39, 898.71),
    (3200, 1110.18, 1046.43),
    (4160, 1298.92, 1280.10),
    (6400, 1305.56, 1302.01),
    (12800, 2080.67, 2205.27),
    (25600, 3353.02, 3617.02),
    (38400, 4629.23, 4922.52),
    (51200, 5745.08, 6217.83),
    (64000, 6845.21, 7367.99),
    (76800, 7890.35, 8468.66),
    (89600, 8697.27, 9666.62),
    (102400, 10105.78, 10652.39),
    (115200, 11136.40, 11571.62),
    (128000, 11462.15, 12360.57),
)
# Table 7: the same 128K prefill (405B, FP8, TP8, CP4 over RDMA) measured on its own at 10.95 s.
TABLE7_128K = 10.95
# Table 4's runs hold a fixed cost per request that Table 7's do not: its 100% row is the very prefill
# Table 7 measures, 0.51 s slower, and below a 10% miss rate both strategies sit 0.4-0.65 s above
# what the hardware and Table 5's per-step times explain. Sized from those two measurements alone (not
# fitted to the other rows), so Table 4's 100% row is its source and no longer a check.
TABLE4_REQUEST_COST = TABLE4[-1][1] / 1e3 - TABLE7_128K


def table4_rows(partial_bytes: int = 2, context: int = 128000) -> list[dict]:
    """The cost model against Table 4: the 405B geometry under TP8, FP8 weights, the h100-rdma preset
    (Table 5's ring and All2All rates), N = 4, plus Table 4's fixed per-request cost
    (`TABLE4_REQUEST_COST`, from its 100% row against Table 7: that row's pass-KV cell is marked
    `source`, not a check). partial_bytes: 2 for Meta's implementation (16-bit partials: what Table 5's All2All sizes
    at the NIC's rate imply), 4 for ours (fp32). The fixed cost is the same for both strategies, so it
    moves no tipping point."""
    shape = replace(shape_of_dtype("llama-3.1-405b", "float8", 8), partial_bytes=partial_bytes)
    m, rows = PRESETS["h100-rdma"], []
    for T, kv, q in TABLE4:
        P = context - T
        pkv, pq = (
            (predict_ttft(s, T, 4, shape, m, P) + TABLE4_REQUEST_COST) * 1e3 for s in ("ring_pass_kv", "ring_pass_q")
        )
        rows.append(dict(T=T, miss=T / context, paper_kv=kv, paper_q=q, kv=pkv, q=pq, source=T == context))
    return rows


def table4_report(partial_bytes: int = 2) -> str:
    """Table 4 next to the cost model's prediction (`predict --table4`), and both tipping points."""
    rows = table4_rows(partial_bytes)
    lines = [
        "| miss rate | T | pass-KV paper | predicted | error | pass-Q paper | predicted | error |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        kv_err, q_err = f"{r['kv'] / r['paper_kv'] - 1:+.0%}", f"{r['q'] / r['paper_q'] - 1:+.0%}"
        if r["source"]:  # pass-KV's 100% row sized the fixed cost; pass-Q's is still a check
            kv_err = f"{kv_err} (source)"
        lines.append(
            f"| {r['miss']:.2%} | {r['T']} | {r['paper_kv']:,.0f} ms | {r['kv']:,.0f} ms | {kv_err} "
            f"| {r['paper_q']:,.0f} ms | {r['q']:,.0f} ms | {q_err} |"
        )
    shape = replace(shape_of_dtype("llama-3.1-405b", "float8", 8), partial_bytes=partial_bytes)
    tip = pass_q_threshold(128000, 4, shape, PRESETS["h100-rdma"])
    lines += [
        "",
        f"Every prediction includes a fixed per-request cost of {TABLE4_REQUEST_COST * 1e3:,.0f} ms that Table 4's runs "
        f"hold: its 100% row ({TABLE4[-1][1]:,.0f} ms) less Table 7's identical prefill ({TABLE7_128K * 1e3:,.0f} ms). "
        "That cell (source) is therefore no check; every other is.",
        f"pass-Q overtakes pass-KV below a miss rate of {tip:.2%} (paper: between 2.5% and 10%, 5%)",
    ]
    return "\n".join(lines)


def csa_keeps(text: str) -> list:
    """--csa: '0.78,0.6:0.6' -> [0.78, (0.6, 0.6)] (CSA's keep: one fraction, or one per level from 2 up)."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        keep = tuple(fractions(item.replace(":", ",")))
        out.append(keep[0] if len(keep) == 1 else keep)
    return out


def csa_rows(T: int, N: int, shape: Shape, m: Machine, tp: int, keeps, node_gpus: int, node_hardware) -> list[str]:
    """Approximate (CSA, issue 41) rows of a fresh prefill: keep-all on the same chain and placement, then each keep
    setting, against ring pass-KV. Ranks per node: node_gpus / tp; node_hardware: the link inside a node (m is
    the one between nodes), or None (m everywhere)."""
    from ..plan.costmodel import predict_csa
    from ..sparse.csa import CSA, SparseRun

    per_node = max(1, node_gpus // tp)
    if N % per_node:
        return [f"| {N} | {N * tp} | csa | - | | | | {N} ranks do not fill nodes of {per_node} |"]
    node = (per_node, machine_of(node_hardware)) if node_hardware else None
    full = [i for i in range(shape.layers) if (shape.windows[i] if i < len(shape.windows) else None) is None]
    ring = predict_ttft("ring_pass_kv", T, N, shape, m, 0)
    ring_bytes = traffic_per_rank("ring_pass_kv", T, 0, N, shape)
    lines = []
    for keep in [(1.0, 1.0, 1.0), *keeps]:
        csa = CSA(keep=keep, topology=(N // per_node, per_node))
        run = SparseRun.of(csa, N, full)
        ttft, sent = predict_csa(T, N, shape, m, run, node)
        levels = ", ".join(f"L{v}={run.csa.fraction(v):g}" for v in run.csa.used_levels())
        what = "keep-all, same chain" if keep == (1.0, 1.0, 1.0) else levels
        lines.append(
            f"| {N} | {N * tp} | csa ({what}) | {format_seconds(ttft)} ({ttft / ring - 1:+.0%} vs pass-KV) | | | "
            f"{format_bytes(sent)} ({sent / ring_bytes - 1:+.0%}) | approximate |"
        )
    return lines


def report(
    model: str,
    hardware: str,
    worlds,
    lengths,
    miss_rates,
    dtype: str = "bfloat16",
    tp: int = 1,
    partial_bytes: int = 4,
    csa=(),
    node_gpus: int = 8,
    node_hardware: str | None = None,
) -> str:
    m = machine_of(hardware)
    shape = replace(shape_of_dtype(model, dtype, tp), partial_bytes=partial_bytes)
    replicas = tp_replicas(model, tp)
    sliding = {w: c for w, c in shape.window_counts().items() if w is not None}
    slides = ", ".join(f"{c} sliding (window {w})" for w, c in sorted(sliding.items()))
    lines = [
        f"model {model} ({shape.layers} layers{': ' + slides if slides else ''}, per CP rank {shape.heads} "
        f"query / {shape.kv_heads} KV heads{f' (each KV head replicated on {replicas} TP ranks)' if replicas > 1 else ''} "
        f"x {shape.head_dim}, {shape.linear_weights * shape.layers / 1e9:.2f} G linear weights), "
        f"{dtype}{' weights, 16-bit activations and KV' if dtype == 'float8' else ''}, TP {tp}",
        f"machine {hardware}: {m.source}; C_attn {m.attn_flops / 1e12:.1f} TFLOP/s, C_gemm "
        f"{m.gemm_flops / 1e12:.1f} TFLOP/s, BW {m.bandwidth / 1e9:.1f} GB/s, latency {m.latency * 1e6:.0f} us, "
        f"memory {m.memory_bandwidth / 1e12:.2f} TB/s",
        "",
    ]
    for context in lengths:
        for rate in miss_rates:
            T = max(1, round(rate * context))
            P = context - T
            lines += [
                f"### context {context} tokens, miss rate {rate:g} (T = {T} new, P = {P} cached)",
                "",
                "| N | GPUs | strategy | TTFT | TTIT | KV / rank | traffic / rank | auto |",
                "|---:|---:|---|---:|---:|---:|---:|---|",
            ]
            for N in worlds:
                base = predict_ttft("ring_pass_kv", T, 1, shape, m, P) if N > 1 else None
                pick = choose(T, P, N, shape, m, "cost").strategy if N > 1 else "-"
                for s in STRATEGIES if N > 1 else ("unpatched",):
                    ttft = predict_ttft(s, T, N, shape, m, P)
                    if ttft is None:
                        continue
                    speed = f" ({base / ttft:.1f}x)" if base else ""
                    lines.append(
                        f"| {N} | {N * tp} | {s} | {format_seconds(ttft)}{speed} | {format_seconds(predict_ttit(context, N, shape, m))} | "
                        f"{format_bytes(kv_bytes_per_rank(context, N, shape))} | "
                        f"{format_bytes(traffic_per_rank(s, T, P, N, shape)) if N > 1 else '0'} | "
                        f"{'<- auto' if s == pick else ''} |"
                    )
                if csa and N > 1 and P == 0:
                    lines += csa_rows(T, N, shape, m, tp, csa, node_gpus, node_hardware)
            lines.append("")
        for N in worlds:
            if N > 1:
                q = pass_q_threshold(context, N, shape, m)
                where = f"below a miss rate of {q:.3g} (T <= {round(q * context)})" if q else "never (pass-KV always)"
                lines.append(f"context {context}, N = {N}: pass-Q overtakes pass-KV {where}")
        lines.append("")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument(
        "--model",
        default="llama-3.1-70b",
        help=f"hub id, config.json, model directory, built-in model, or one of {sorted(GEOMETRIES)}",
    )
    p.add_argument("--hardware", default="h100-rdma", help=f"{sorted(PRESETS)}, 'cpu', or a calibration JSON")
    p.add_argument("--world", type=positive_ints, default="1,2,4,8", help="CP world sizes N, comma-separated")
    p.add_argument("--tp", type=positive_int, default=1, help="GPUs per CP rank (tensor parallel inside a rank)")
    p.add_argument("--lengths", type=positive_ints, default="131072,1048576", help="context lengths, comma-separated")
    p.add_argument(
        "--miss-rates",
        type=fractions,
        default="1.0",
        help="KV-cache miss rates T/(T+P) in (0, 1], comma-separated (1 = full prefill)",
    )
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16")
    p.add_argument(
        "--gpus",
        type=positive_ints,
        help="recommend a (tp, cp) layout for each of these GPU counts instead (tools/layout.py), e.g. 8,16,64",
    )
    p.add_argument("--node-gpus", type=positive_int, default=8, help="GPUs per node: TP stays inside one (--gpus)")
    p.add_argument("--gpu-memory", type=float, default=80.0, help="GB of memory per GPU (--gpus; default 80)")
    p.add_argument(
        "--partials",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of pass-Q's partial outputs sent home: float32 is what hf-contextpar sends, bfloat16 Meta's",
    )
    p.add_argument(
        "--csa",
        type=csa_keeps,
        default=None,
        help="APPROXIMATE: add CSA rows (issue 41) for fresh prefills, one per setting (comma-separated): a level-2 "
        "keep fraction, each farther level half (0.78), or one per level from 2 up joined by ':' (0.78:0.78: CSPS's "
        "zero-loss drop of 22%% at every level), beside keep-all CSA and ring pass-KV",
    )
    p.add_argument(
        "--node-hardware",
        help="with --csa: the link inside a node (a preset, e.g. h100-nvlink); --hardware is then the one between "
        "nodes, and --node-gpus / --tp ranks share a node (default: --hardware everywhere)",
    )
    p.add_argument(
        "--table4",
        action="store_true",
        help="print the Meta CP paper's Table 4 (405B, 128K, 4 nodes) next to the prediction and exit",
    )


def run(args) -> str:
    if args.table4:
        text = table4_report(2 if args.partials == "bfloat16" else 4)
        print(text)
        return text
    if args.gpus:
        from .layout import report as layouts

        text = layouts(args.model, args.hardware, args.gpus, args.lengths, args.dtype, args.node_gpus, args.gpu_memory)
        print(text)
        return text
    text = report(
        args.model,
        args.hardware,
        args.world,
        args.lengths,
        args.miss_rates,
        args.dtype,
        args.tp,
        2 if args.partials == "bfloat16" else 4,
        csa=args.csa or (),
        node_gpus=args.node_gpus,
        node_hardware=args.node_hardware,
    )
    print(text)
    return text
