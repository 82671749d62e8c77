"""Roofline prediction of time-to-first-token per prefill strategy (Meta CP paper 3.4).

Per layer and rank, a full prefill of T tokens (no cache) on N ranks costs
    linear     W T / N * 2 / C_gemm                 (W: weights of one decoder layer's linear maps)
    attention  A = 4 H d (T^2/2) / N / C_attn        (causal: half of T x T; head-tail shards split it evenly)
and the strategies differ in what they send and what overlaps (alpha: one message's latency,
BW: ring bandwidth, e: bytes per element, Hkv: KV heads, H: query heads):
    ring_pass_kv   (N-1) max(A/N, alpha + 2 (T/N) Hkv d e / BW) + A/N               (Alg. 2, overlapped)
    ring_pass_q    (N-1) max(A/N, alpha + (T/N) H d e / BW) + A/N
                   + alpha + (N-1) (T/N) H (d+1) 4 / BW                              (Alg. 3 + All2All home)
    allgather_kv   alpha + (N-1) (T/N) 2 Hkv d e / BW + A                            (gather, then attend)
    kv_runahead    the last rank of an even contiguous split: attention over all T keys for its T/N
                   queries, 4 H d (T/N)(T - T/(2N)), plus (N-1) hops of the growing prefix chain
    ulysses        2 alpha + ((N-1)/N) (T/N) (H + 2 max(Hkv, N)) d e / BW + A        (two All2All, QKV in, O out)
                   + ((N-1)/N) (T/N) H d e / BW
Every forward adds `per_forward_collectives` small collectives (input check, logits gather).
C_attn is measured on a fully visible block (what the causal FLOP count above divides by),
C_gemm on a matmul the size of the model's MLP, BW and alpha on the running process group.
N = 1 is the unpatched model: L (linear + A).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Machine:
    attn_flops: float  # C_attn: achieved FLOP/s of the local attention kernel, per rank
    gemm_flops: float  # C_gemm: achieved FLOP/s of the linear layers, per rank
    bandwidth: float = float("inf")  # BW: ring send/recv bytes/s (N >= 2)
    latency: float = 0.0  # alpha: seconds of one small collective / message (N >= 2)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Shape:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    linear_weights: int  # elements of one decoder layer's linear weights (q, k, v, o, MLP)
    elem_bytes: int

    @classmethod
    def from_model(cls, model) -> "Shape":
        import torch

        text = model.config.get_text_config(decoder=True)
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        layer = model.get_decoder().layers[0]
        weights = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
        elem = next(model.parameters()).element_size()
        return cls(text.num_hidden_layers, heads, getattr(text, "num_key_value_heads", None) or heads, head_dim,
                   weights, elem)


PER_FORWARD_COLLECTIVES = 2  # runtime.py: the input check and the logits gather, one all-gather each


def attention_flops(T: int, shape: Shape) -> float:
    """Causal self-attention FLOPs of one layer over T tokens: QK^T and PV over the lower triangle."""
    return 4.0 * shape.heads * shape.head_dim * T * T / 2


def predict_ttft(strategy: str, T: int, N: int, shape: Shape, m: Machine) -> float | None:
    """Predicted TTFT (seconds) of a full prefill of T tokens; None for a strategy the model does not know."""
    e, d, h, kv = shape.elem_bytes, shape.head_dim, shape.heads, shape.kv_heads
    linear = 2.0 * shape.linear_weights * T / N / m.gemm_flops
    a = attention_flops(T, shape) / N / m.attn_flops  # one rank's share of the causal attention
    if N == 1:  # the unpatched model (a patch on one process changes nothing)
        return shape.layers * (linear + a)
    chunk = T / N
    if strategy == "ring_pass_kv":
        msg = m.latency + 2 * chunk * kv * d * e / m.bandwidth
        attn = (N - 1) * max(a / N, msg) + a / N
    elif strategy == "ring_pass_q":
        msg = m.latency + chunk * h * d * e / m.bandwidth
        attn = (N - 1) * max(a / N, msg) + a / N + m.latency + (N - 1) * chunk * h * (d + 1) * 4 / m.bandwidth
    elif strategy == "allgather_kv":
        attn = m.latency + (N - 1) * chunk * 2 * kv * d * e / m.bandwidth + a
    elif strategy == "kv_runahead":
        last = 4.0 * h * d * chunk * (T - chunk / 2) / m.attn_flops
        chain = sum(m.latency + 2 * (i * chunk) * kv * d * e / m.bandwidth for i in range(1, N))
        attn = last + chain
    elif strategy == "ulysses":
        qkv = (N - 1) / N * chunk * (h + 2 * max(kv, N)) * d * e / m.bandwidth
        out = (N - 1) / N * chunk * h * d * e / m.bandwidth
        attn = 2 * m.latency + qkv + out + a
    else:
        return None
    return shape.layers * (linear + attn) + PER_FORWARD_COLLECTIVES * m.latency


def exposed_comm(strategy: str, T: int, N: int, shape: Shape, m: Machine) -> float | None:
    """Predicted communication time not hidden behind compute (seconds), for comparison with comm wait."""
    if N == 1:
        return 0.0
    no_comm = Machine(m.attn_flops, m.gemm_flops, float("inf"), 0.0)
    full, bare = predict_ttft(strategy, T, N, shape, m), predict_ttft(strategy, T, N, shape, no_comm)
    return None if full is None else full - bare


def decode_floor(shape: Shape, m: Machine) -> float:
    """The least per-token cost of sharded-KV decode over one process: one small collective per layer."""
    return shape.layers * m.latency
