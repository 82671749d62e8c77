"""Published model geometries and hardware presets for `predict` (no hub access needed).

Presets use published or measured figures; your own measured constants (`calibrate`) beat them.
"""

from __future__ import annotations

from ..costmodel import Machine

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
