"""`python -m hf_contextpar predict --gpus 8,16,64`: which (tp, cp) layout to run a model on G GPUs,
and why, from the one cost model.

    python -m hf_contextpar predict --model llama-3.1-70b --hardware h100-rdma --gpus 8,16,64 \\
        --lengths 131072,1048576

Every layout tp x cp = G with tp inside one node (`--node-gpus`, TP's all-reduces need NVLink) and
tp dividing the KV heads (as hf_contextpar.mesh loads them; fewer KV heads than tp would need DCP,
which is not implemented): per GPU the weights (1/tp of every layer's linear maps and of the
embedding and head, all sharded by transformers' plans for these families) and the KV cache of the
context (1/(cp tp) of it: each TP rank holds kv_heads / tp heads, each CP rank 1/cp of the tokens),
whether they fit `--gpu-memory` less 10% for activations and workspace, then the predicted TTFT of a
fresh prefill with the strategy `auto` picks and the TTIT of the decode after it. TP's own traffic
is modelled as two ring all-reduces of the layer's activations per layer over NVLink (the
h100-nvlink preset: Megatron-style TP, the o_proj and down_proj outputs); CP's with `--hardware`.
CP's traffic is costed at `--hardware`'s bandwidth even where a CP group stays inside one node
(conservative for small G). The recommendation: of the layouts that fit, those whose TTFT is within
10% of the fastest, the one with the lowest TTIT (TP divides the weights every decode step reads,
CP does not; their prefills cost about the same FLOPs per GPU, so they differ by communication).
Memory is in GB of 1e9 bytes (`--gpu-memory`), the tables print GiB.
"""

from __future__ import annotations

from ..plan.choice import choose
from ..plan.costmodel import kv_bytes_per_rank, predict_ttit
from ..plan.machine import Machine
from .presets import DTYPE_BYTES, PRESETS, machine_of, shape_of

HEADROOM = 0.9  # of a GPU's memory for weights and KV cache; the rest for activations and workspace
NVLINK = PRESETS["h100-nvlink"]
TTFT_SLACK = 0.10  # a prefill this much slower is worth a faster decode


def geometry(model: str) -> dict:
    """hidden size, vocabulary, query and KV heads of a model (predict's published geometries or its config)."""
    from .presets import GEOMETRIES, load_config

    if model in GEOMETRIES:
        g = GEOMETRIES[model]
        return dict(
            hidden=g["hidden_size"],
            vocab=g.get("vocab_size", 0),
            heads=g["num_attention_heads"],
            kv=g["num_key_value_heads"],
        )
    text = load_config(model).get_text_config(decoder=True)
    heads = text.num_attention_heads
    return dict(
        hidden=text.hidden_size,
        vocab=text.vocab_size,
        heads=heads,
        kv=getattr(text, "num_key_value_heads", None) or heads,
    )


def tp_allreduce_s(tokens: float, hidden: int, elem: int, tp: int, link: Machine = NVLINK) -> float:
    """One ring all-reduce of `tokens` x hidden activations over tp GPUs of a node."""
    if tp == 1:
        return 0.0
    return link.latency + 2 * (tp - 1) / tp * tokens * hidden * elem / link.bandwidth


def layouts(model: str, gpus: int, context: int, m: Machine, dtype: str, node: int, memory: float) -> list[dict]:
    """Every (tp, cp) layout of `gpus` GPUs with its memory per GPU, TTFT and TTIT."""
    from ..plan.costmodel import predict_ttft

    e, geo, rows = DTYPE_BYTES[dtype], geometry(model), []
    for tp in (t for t in range(1, min(node, gpus) + 1) if gpus % t == 0 and geo["heads"] % t == 0):
        if geo["kv"] % tp:  # a KV head split over TP ranks: needs DCP (not implemented)
            continue
        cp, shape = gpus // tp, shape_of(model, e, tp)
        weights = (shape.linear_weights * shape.layers + 2 * geo["vocab"] * geo["hidden"] // tp) * e
        kv = kv_bytes_per_rank(context, cp, shape)
        strategy = choose(context, 0, cp, shape, m, "cost").strategy if cp > 1 else "ring_pass_kv"
        tp_prefill = shape.layers * 2 * tp_allreduce_s(context / cp, geo["hidden"], e, tp)
        tp_decode = shape.layers * 2 * tp_allreduce_s(1, geo["hidden"], e, tp)
        rows.append(
            dict(
                tp=tp,
                cp=cp,
                weights=weights,
                kv=kv,
                fits=weights + kv <= HEADROOM * memory,
                strategy=strategy if cp > 1 else "-",
                ttft=predict_ttft(strategy, context, cp, shape, m) + tp_prefill,
                ttit=predict_ttit(context, cp, shape, m) + tp_decode,
            )
        )
    return rows


def recommend(rows: list[dict]) -> dict | None:
    """Of the layouts that fit, those within TTFT_SLACK of the fastest prefill; of these the fastest decode."""
    fitting = [r for r in rows if r["fits"]]
    if not fitting:
        return None
    fastest = min(r["ttft"] for r in fitting)
    return min((r for r in fitting if r["ttft"] <= (1 + TTFT_SLACK) * fastest), key=lambda r: (r["ttit"], r["ttft"]))


def report(
    model: str, hardware: str, gpu_counts, lengths, dtype: str = "bfloat16", node: int = 8, memory_gb: float = 80.0
) -> str:
    m, memory = machine_of(hardware), memory_gb * 1e9
    lines = [
        f"model {model}, {dtype}; CP over {hardware} ({m.source}); TP inside nodes of {node} GPUs over NVLink "
        f"({NVLINK.bandwidth / 1e9:.0f} GB/s); {memory_gb:g} GB per GPU, {HEADROOM:.0%} for weights and KV",
        "",
    ]
    for gpus in gpu_counts:
        for context in lengths:
            rows = layouts(model, gpus, context, m, dtype, node, memory)
            best = recommend(rows)
            lines += [
                f"### {gpus} GPUs, context {context} tokens",
                "",
                "| TP | CP | weights / GPU | KV / GPU | fits | strategy | TTFT | TTIT |",
                "|---:|---:|---:|---:|---|---|---:|---:|",
            ]
            for r in rows:
                mark = " <- recommended" if r is best else ""
                lines.append(
                    f"| {r['tp']} | {r['cp']} | {format_bytes(r['weights'])} | {format_bytes(r['kv'])} | "
                    f"{'yes' if r['fits'] else 'no'} | {r['strategy']} | {format_seconds(r['ttft'])}{mark} | "
                    f"{format_seconds(r['ttit'])} |"
                )
            lines += ["", why(best, rows, memory), ""]
    return "\n".join(lines)


def why(best: dict | None, rows: list[dict], memory: float) -> str:
    if best is None:
        least = min(rows, key=lambda r: r["weights"] + r["kv"]) if rows else None
        need = (
            f" (the least is {format_bytes(least['weights'] + least['kv'])} per GPU at TP {least['tp']})"
            if least
            else ""
        )
        return f"no layout fits {HEADROOM:.0%} of {memory / 1e9:g} GB per GPU{need}: more GPUs or a shorter context."
    others = [r for r in rows if r["fits"] and r is not best]
    fastest = min(others + [best], key=lambda r: r["ttft"])
    text = (
        f"recommended: TP {best['tp']} x CP {best['cp']}: {format_bytes(best['weights'] + best['kv'])} per GPU, "
        f"TTFT {format_seconds(best['ttft'])}, TTIT {format_seconds(best['ttit'])}"
    )
    if fastest is not best:
        text += (
            f" (TP {fastest['tp']} x CP {fastest['cp']} prefills {best['ttft'] / fastest['ttft'] - 1:.0%} faster but "
            f"decodes at {format_seconds(fastest['ttit'])} a token)"
        )
    unfit = [f"TP {r['tp']}" for r in rows if not r["fits"]]
    if unfit:
        text += f"; {', '.join(unfit)} {'does' if len(unfit) == 1 else 'do'} not fit (weights + KV per GPU)"
    return text + "."


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
