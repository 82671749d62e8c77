"""`python -m hf_contextpar predict`: context parallelism on paper, from the one cost model.

    python -m hf_contextpar predict --model llama-3.1-70b --hardware h100-rdma --tp 8 --world 1,8 \\
        --lengths 131072,1048576 --miss-rates 1,0.1,0.01

For a model (a hub id, a config.json or a model directory, a built-in model, or one of the
published geometries below) on a machine (a preset below, or a calibration JSON from `python -m
hf_contextpar calibrate`), prints per CP world size N, context length and KV-cache miss rate:
each strategy's predicted TTFT (costmodel.predict_ttft), TTIT of the decode that follows (one
token, sharded-KV decode), KV cache and attention traffic per rank, which strategy `auto` picks,
and the miss rate below which pass-Q overtakes pass-KV. `--tp` spreads each CP rank over that many
GPUs (Meta's layout: TP8 inside a node, CP across nodes), each with the heads the model's TP plan
leaves it (`tp_heads`; TP's own communication is not modelled). `--table4` checks the model against
the Meta CP paper's measured partial prefill. Presets use published or measured figures; your own
measured constants (`calibrate`) beat them.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace

from ..costmodel import (
    PER_FORWARD_COLLECTIVES,
    Machine,
    Shape,
    config_windows,
    kept_keys,
    predict_ttft,
    ulysses_fits,
)
from ..errors import ContextParallelError
from ..planner import choose
from .cliargs import fractions, positive_int, positive_ints
from .presets import GEOMETRIES, PRESETS

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}  # float8: weights; activations 16-bit
STRATEGIES = ("ring_pass_kv", "ring_pass_q", "allgather_kv", "kv_runahead", "ulysses")


LLAMA_TP_PLAN = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise"}


def shape_of(model: str, elem_bytes: int, tp: int = 1, weight_bytes: int = 0) -> Shape:
    """The cost model's shape of one CP rank (a TP group of `tp` GPUs counts as one rank), with the
    heads each GPU's attention gets under the model's TP plan (`tp_heads`). weight_bytes: FP8
    weights (1) with 16-bit activations and KV, as in Meta's runs; 0: elem_bytes."""
    if model in GEOMETRIES:
        g = GEOMETRIES[model]
        layers, hidden, inter = g["num_hidden_layers"], g["hidden_size"], g["intermediate_size"]
        heads, kv, d = g["num_attention_heads"], g["num_key_value_heads"], g["head_dim"]
        windows, plan = g.get("windows", ()), LLAMA_TP_PLAN  # all four are Llama-style: q/k/v colwise
    else:
        config = load_config(model)
        text = config.get_text_config(decoder=True)
        layers, hidden, inter = text.num_hidden_layers, text.hidden_size, text.intermediate_size
        heads = text.num_attention_heads
        kv = getattr(text, "num_key_value_heads", None) or heads
        d = getattr(text, "head_dim", None) or hidden // heads
        windows, plan = config_windows(config), getattr(text, "base_model_tp_plan", None) or {}
    h, k, _ = tp_heads(heads, kv, tp, plan)
    # q, o: the query heads a rank attends with; k, v: its KV heads (a replicated head's weights on each
    # of its ranks); the gated MLP split over the TP group
    weights = hidden * h * d * 2 + hidden * k * d * 2 + 3 * hidden * inter // tp
    return Shape(layers, h, k, d, weights, elem_bytes, windows, weight_bytes=weight_bytes)


def tp_heads(heads: int, kv: int, tp: int, plan: dict) -> tuple[int, int, int]:
    """(query heads, KV heads, ranks holding each KV head) per GPU of a TP group, as transformers' TP
    plan leaves them: `colwise` q/k/v projections split the heads over the group, and where there
    are fewer KV heads than ranks each KV head is replicated on tp / kv of them (max(1, kv / tp) per
    rank); a fused projection the plan gathers back (phi3's `colwise_gather_output`) leaves every
    rank all heads (mesh.heads_per_rank reads the same from a loaded model)."""
    if tp == 1:
        return heads, kv, 1
    styles = {k.rsplit(".", 1)[-1]: v for k, v in plan.items() if "attn" in k}
    fused = styles.get("qkv_proj") or styles.get("query_key_value") or ""
    if fused.endswith("gather_output") or styles.get("q_proj", "").endswith("gather_output"):
        return heads, kv, tp
    if heads % tp:
        raise SystemExit(f"--tp {tp} does not divide the model's {heads} query heads.")
    if kv >= tp:
        if kv % tp:
            raise SystemExit(f"--tp {tp} does not divide the model's {kv} KV heads.")
        return heads // tp, kv // tp, 1
    if tp % kv:
        raise SystemExit(f"--tp {tp} is not a multiple of the model's {kv} KV heads (each is replicated).")
    return heads // tp, 1, tp // kv


def shape_of_dtype(model: str, dtype: str, tp: int = 1) -> Shape:
    """shape_of for a --dtype: float8 is FP8 weights with 16-bit activations, K/V and messages."""
    if dtype == "float8":
        return shape_of(model, 2, tp, weight_bytes=1)
    return shape_of(model, DTYPE_BYTES[dtype], tp)


def tp_replicas(model: str, tp: int) -> int:
    """How many TP ranks hold each KV head (1: the heads are split, not replicated)."""
    if tp == 1:
        return 1
    if model in GEOMETRIES:
        g = GEOMETRIES[model]
        return tp_heads(g["num_attention_heads"], g["num_key_value_heads"], tp, LLAMA_TP_PLAN)[2]
    text = load_config(model).get_text_config(decoder=True)
    kv = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return tp_heads(text.num_attention_heads, kv, tp, getattr(text, "base_model_tp_plan", None) or {})[2]


def load_config(model: str):
    from transformers import AutoConfig

    from .models import TINY_CONFIGS, builtin_model_path, tiny_config

    if model.startswith("tiny-") and model[5:] in TINY_CONFIGS:
        return tiny_config(model[5:])
    if model.endswith(".json") and os.path.isfile(model):
        return AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(model)) or ".")
    model = builtin_model_path(model) or model
    try:
        return AutoConfig.from_pretrained(model)
    except OSError as e:
        raise SystemExit(
            f"could not load a config for '{model}' ({e}); use a config.json, a model directory, a "
            f"cached hub id, a built-in model or one of {sorted(GEOMETRIES)}."
        ) from None


def machine_of(hardware: str) -> Machine:
    if hardware in PRESETS:
        return PRESETS[hardware]
    if hardware == "cpu":
        return Machine.resolve(None, "cpu")
    if os.path.isfile(hardware):
        try:
            return Machine.load(hardware)
        except (ValueError, KeyError, TypeError, ContextParallelError) as e:  # JSONDecodeError is a ValueError
            raise SystemExit(f"--hardware {hardware}: not a usable calibration JSON from `calibrate` ({e}).") from None
    raise SystemExit(
        f"--hardware must be one of {sorted(PRESETS)}, 'cpu' (the saved calibration, else defaults) "
        "or a calibration JSON from `python -m hf_contextpar calibrate`."
    )


def kv_bytes_per_rank(context: int, N: int, shape: Shape) -> float:
    """After a prefill of `context` tokens: 1/N of what each layer keeps (a sliding layer window - 1)."""
    tokens = sum(count * kept_keys(context, w) for w, count in shape.window_counts().items())
    return 2 * tokens / N * shape.kv_heads * shape.head_dim * shape.elem_bytes


def traffic_per_rank(strategy: str, T: int, P: int, N: int, shape: Shape) -> float | None:
    """Attention bytes one rank sends during a prefill (the average rank; the tests check the exact formulas)."""
    if N == 1:
        return 0.0
    e, d, h, kv = shape.elem_bytes, shape.head_dim, shape.heads, shape.kv_heads
    total = 0.0
    for w, count in shape.window_counts().items():
        keys = T + kept_keys(P, w)  # what pass-KV and all-gather carry: the new tokens and what the layer kept
        per_layer = {
            "ring_pass_kv": (N - 1) * 2 * keys / N * kv * d * e,
            "ring_pass_q": (N - 1) * T / N * h * d * e + (N - 1) * T / N * h * (d + 1) * shape.partial_bytes,
            "allgather_kv": (N - 1) * 2 * keys / N * kv * d * e,
            "kv_runahead": sum(i + 1 for i in range(N - 1)) / N * 2 * T / N * kv * d * e if P == 0 else None,
            "ulysses": (N - 1) / N * T / N * (2 * h + 2 * kv) * d * e if P == 0 and ulysses_fits(h, kv, N) else None,
        }[strategy]
        if per_layer is None:
            return None
        total += count * per_layer
    return total


def predict_ttit(context: int, N: int, shape: Shape, m: Machine) -> float:
    """One decode step at `context` tokens, batch 1 (sharded-KV decode): every rank reads the weights
    and its 1/N of each layer's KV cache (memory-bound at batch 1; a sliding layer's window), then
    one small collective per layer."""
    bw = m.memory_bandwidth
    linear = max(2.0 * shape.linear_weights / m.gemm_flops, shape.linear_weights * shape.weight_elem_bytes / bw)
    total = 0.0
    for w, count in shape.window_counts().items():
        keys = kept_keys(context, w) + 1
        attention = max(
            4.0 * shape.heads * shape.head_dim * keys / N / m.attn_flops,
            2 * keys / N * shape.kv_heads * shape.head_dim * shape.elem_bytes / bw,
        )
        total += count * (linear + attention + (m.latency if N > 1 else 0.0))
    return total + (PER_FORWARD_COLLECTIVES * m.latency if N > 1 else 0.0)


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


def table4_rows(partial_bytes: int = 2, context: int = 128000) -> list[dict]:
    """The cost model against Table 4 with nothing taken from Table 4: the 405B geometry under TP8,
    FP8 weights, the h100-rdma preset (Table 5's ring and All2All rates), N = 4. partial_bytes: 2
    for Meta's implementation (16-bit partials: what Table 5's All2All sizes at the NIC's rate
    imply), 4 for ours (fp32)."""
    shape = replace(shape_of_dtype("llama-3.1-405b", "float8", 8), partial_bytes=partial_bytes)
    m, rows = PRESETS["h100-rdma"], []
    for T, kv, q in TABLE4:
        P = context - T
        pkv, pq = (predict_ttft(s, T, 4, shape, m, P) * 1e3 for s in ("ring_pass_kv", "ring_pass_q"))
        rows.append(dict(T=T, miss=T / context, paper_kv=kv, paper_q=q, kv=pkv, q=pq))
    return rows


def table4_report(partial_bytes: int = 2) -> str:
    """Table 4 next to the cost model's prediction (`predict --table4`), and both tipping points."""
    rows = table4_rows(partial_bytes)
    lines = [
        "| miss rate | T | pass-KV paper | predicted | error | pass-Q paper | predicted | error |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['miss']:.2%} | {r['T']} | {r['paper_kv']:,.0f} ms | {r['kv']:,.0f} ms | {r['kv'] / r['paper_kv'] - 1:+.0%} "
            f"| {r['paper_q']:,.0f} ms | {r['q']:,.0f} ms | {r['q'] / r['paper_q'] - 1:+.0%} |"
        )
    shape = replace(shape_of_dtype("llama-3.1-405b", "float8", 8), partial_bytes=partial_bytes)
    tip = pass_q_threshold(128000, 4, shape, PRESETS["h100-rdma"])
    lines += ["", f"pass-Q overtakes pass-KV below a miss rate of {tip:.2%} (paper: between 2.5% and 10%, 5%)"]
    return "\n".join(lines)


def format_seconds(x):
    if x is None:
        return "-"
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def format_bytes(x):
    if x is None:
        return "-"
    for unit, div in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if x >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x / 2**10:.1f} KiB"


def report(
    model: str, hardware: str, worlds, lengths, miss_rates, dtype: str = "bfloat16", tp: int = 1, partial_bytes: int = 4
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
    )
    print(text)
    return text
