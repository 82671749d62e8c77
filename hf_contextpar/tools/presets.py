"""Published model geometries and hardware presets for `predict` (no hub access needed), and the cost
model's `Shape` and `Machine` of a model name or config and a hardware name or calibration file.

Presets use published or measured figures; your own measured constants (`calibrate`) beat them.
"""

from __future__ import annotations

import os

from ..errors import ContextParallelError
from ..model.shape import config_windows
from ..plan.costmodel import Shape
from ..plan.machine import Machine

# Achieved attention FLOP/s: Flash Attention 3, 8K causal on one H100 (540 TF/s, Meta CP paper App. A);
# linear layers at Meta's achieved 502 TF/s per H100 at 1M tokens (App. A); HBM3 3.35 TB/s (H100 SXM
# datasheet). An H100 SXM has 132 SMs (datasheet) and FA3 gives each one query tile of 128 rows x one
# head (d = 128) at a time, streaming every key: an attention call takes whole waves of 132 tiles
# (`Machine.occupancy`, measured on an H200's 132 SMs). Bandwidth per GPU and direction: NVLink 4
# 900 GB/s bidirectional (datasheet); TCP 100 Gb/s per GPU of which ~3 GB/s per rank was achieved
# (Meta's GTI hosts, 4.2.1). RDMA: what Meta measured per ring step on its GTT hosts (400 Gb/s per
# GPU), Table 5 (`RDMA_TABLE5`): pass-Q's SendRecv of a 16-bit query block, 3.28 MB in 166 us and
# 13.1 MB in 544 us, is 26 GB/s after 40 us (pass-KV's 16.4 MB: 670 us predicted, 627 / 631 measured);
# its All2All of 16-bit partial outputs + LSE, 9.9 MB in 424 us and 39.6 MB in 1,023 us, is the NIC's
# 50 GB/s after 224 us. Other latencies are typical NCCL small-message figures (assumed).
_H100 = dict(attn_flops=5.4e14, gemm_flops=5.0e14, memory_bandwidth=3.35e12, compute_units=132, query_tile=128)
# Meta CP paper Table 5 (Llama 3 405B, 4 GTT nodes, TP8, 128K context; per GPU and ring step):
# (new tokens T, pass-Q SendRecv us, All2All us) at 2.5% and 10% miss rates.
RDMA_TABLE5 = ((3200, 166e-6, 424e-6), (12800, 544e-6, 1023e-6))


def line_through(points) -> tuple[float, float]:
    """(bandwidth, latency) of the line t = latency + bytes / bandwidth through two (bytes, t)."""
    (b1, t1), (b2, t2) = points
    bandwidth = (b2 - b1) / (t2 - t1)
    return bandwidth, t1 - b1 / bandwidth


def rdma_from_table5(N: int = 4, heads: int = 16, d: int = 128, e: int = 2) -> dict:
    """The RDMA preset's ring and All2All rates from Table 5's per-step times and the message sizes
    of its runs (405B under TP8: 16 query heads per GPU, d 128, 16-bit activations, N = 4)."""
    q_msg = [(T / N * heads * d * e, t) for T, t, _ in RDMA_TABLE5]
    home = [((N - 1) * T / N * heads * (d + 1) * e, t) for T, _, t in RDMA_TABLE5]
    (bw, lat), (a2a_bw, a2a_lat) = line_through(q_msg), line_through(home)
    return dict(bandwidth=bw, latency=lat, all2all_bandwidth=a2a_bw, all2all_latency=a2a_lat)


PRESETS = {
    "h100-nvlink": Machine(**_H100, bandwidth=4.5e11, latency=1e-5, source="preset: H100 SXM, NVLink inside a node"),
    "h100-rdma": Machine(
        **_H100, **rdma_from_table5(), source="preset: H100, RDMA 400 Gb/s between nodes (Meta's Table 5 rates)"
    ),
    "h100-tcp": Machine(**_H100, bandwidth=3.0e9, latency=5e-5, source="preset: H100, TCP, ~3 GB/s achieved per rank"),
}

# Published geometries (config.json fields), so the tool runs with no hub access.
GEOMETRIES = {
    "llama-3.2-1b": dict(
        num_hidden_layers=16,
        hidden_size=2048,
        intermediate_size=8192,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
    "llama-3.1-8b": dict(
        num_hidden_layers=32,
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
    ),
    "llama-3.1-70b": dict(
        num_hidden_layers=80,
        hidden_size=8192,
        intermediate_size=28672,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
    ),
    "llama-3.1-405b": dict(
        num_hidden_layers=126,
        hidden_size=16384,
        intermediate_size=53248,
        num_attention_heads=128,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
    ),
    # Gemma 3 27B: five sliding layers (window 1024) to one full one
    "gemma-3-27b": dict(
        num_hidden_layers=62,
        hidden_size=5376,
        intermediate_size=21504,
        num_attention_heads=32,
        num_key_value_heads=16,
        head_dim=128,
        vocab_size=262208,
        windows=tuple(None if (i + 1) % 6 == 0 else 1024 for i in range(62)),
    ),
}


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}  # float8: weights; activations 16-bit


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

    from ..models import TINY_CONFIGS, builtin_model_path, tiny_config

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
