"""Choosing ring pass-KV or ring pass-Q for each prefill call (Meta CP paper 3.4, Alg. 5, App. D).

Per layer and rank, with T new tokens, P cached tokens, N ranks, N_H query heads, N_KV KV heads,
head dim d, e bytes per element, C the achieved attention FLOP/s and BW the achieved ring
bandwidth (bytes/s), a ring step costs
    compute  c   = 4 T (T+P) N_H d / (N^2 C)
    pass-KV  m_kv = 2 (T+P)/N N_KV d e / BW        (one rank's K and V)
    pass-Q   m_q  = (T/N) N_H d e / BW              (one rank's queries)
and pass-Q adds an All2All of (N-1) (T/N) N_H (d+1) e_acc / BW. The ring time is
(N-1) max(c, m) + c. Requiring pass-KV's exposed ring time to stay under pass-Q's All2All gives
Alg. 5 exactly:  pass-KV iff  T >= N C N_KV e / (2 N_H BW)  or
                 T/(T+P) >= 2 N_KV/N_H - 4 T BW / (N C e).
C and BW are machine facts: `python -m hf_contextpar calibrate` measures them and saves them;
without a calibration file the planner uses the defaults below. The empirical rule of App. D,
h(T,P) = a log T + b log(T/(T+P)) + c (pass-KV iff h > 0), is available too, with coefficients
refit from measured timings by `fit_h`.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field

logger = logging.getLogger("hf_contextpar.planner")

# Defaults when nothing was calibrated: a CPU core with gloo over loopback, a GPU with NVLink.
DEFAULTS = {"cpu": dict(attn_flops=2.0e10, bandwidth=1.0e9), "cuda": dict(attn_flops=3.0e14, bandwidth=1.0e11)}
PAPER_H = (-1.059, 1.145, 12.112)  # (a, b, c) fitted on Meta's H100 cluster


def calibration_path() -> str:
    return os.environ.get("HF_CONTEXTPAR_CALIBRATION",
                          os.path.join(os.path.expanduser("~"), ".cache", "hf_contextpar", "calibration.json"))


@dataclass
class Calibration:
    attn_flops: float  # C: achieved attention FLOP/s of one rank's local kernel
    bandwidth: float  # BW: achieved ring send/recv bandwidth, bytes/s
    source: str = "default"
    h_coefficients: tuple = PAPER_H
    details: dict = field(default_factory=dict)

    def save(self, path: str | None = None) -> str:
        path = path or calibration_path()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)
        return path

    @classmethod
    def load(cls, path: str) -> "Calibration":
        with open(path) as f:
            data = json.load(f)
        data["h_coefficients"] = tuple(data.get("h_coefficients", PAPER_H))
        return cls(**data)

    @classmethod
    def resolve(cls, calibration=None, device_type: str = "cpu") -> "Calibration":
        """An explicit Calibration / dict / path, else the saved file, else the defaults."""
        if isinstance(calibration, Calibration):
            return calibration
        if isinstance(calibration, dict):
            return cls(**calibration)
        path = calibration or calibration_path()
        if os.path.exists(path):
            return cls.load(path)
        if calibration:
            raise FileNotFoundError(f"calibration file {path} does not exist; run `python -m hf_contextpar calibrate`.")
        return cls(**DEFAULTS.get(device_type, DEFAULTS["cpu"]), source="default")


@dataclass
class Decision:
    strategy: str
    rule: str
    T: int
    P: int
    N: int
    predicted_pass_kv_s: float
    predicted_pass_q_s: float
    threshold_T: float
    threshold_miss_rate: float


@dataclass
class ModelShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    elem_bytes: int

    @classmethod
    def from_config(cls, config, elem_bytes: int) -> "ModelShape":
        text = config.get_text_config(decoder=True)
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(heads, getattr(text, "num_key_value_heads", None) or heads, head_dim, elem_bytes)


def predicted_times(T: int, P: int, N: int, shape: ModelShape, cal: Calibration) -> tuple[float, float]:
    """Roofline time of one layer's attention for pass-KV and pass-Q (seconds)."""
    h, kv, d, e = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.elem_bytes
    c = 4 * T * (T + P) * h * d / (N * N * cal.attn_flops)
    m_kv = 2 * (T + P) / N * kv * d * e / cal.bandwidth
    m_q = T / N * h * d * e / cal.bandwidth
    all2all = (N - 1) * T / N * h * (d + 1) * 4 / cal.bandwidth
    return (N - 1) * max(c, m_kv) + c, (N - 1) * max(c, m_q) + c + all2all


def alg5_prefers_pass_kv(T: int, P: int, N: int, shape: ModelShape, cal: Calibration) -> tuple[bool, float, float]:
    """Meta Alg. 5; also returns its two thresholds (on T, and on the miss rate T/(T+P))."""
    h, kv, e = shape.num_heads, shape.num_kv_heads, shape.elem_bytes
    t_threshold = N * cal.attn_flops * kv * e / (2 * h * cal.bandwidth)
    miss_threshold = 2 * kv / h - 4 * T * cal.bandwidth / (N * cal.attn_flops * e)
    return T >= t_threshold or T / (T + P) >= miss_threshold, t_threshold, miss_threshold


def empirical_h(T: int, P: int, coefficients=PAPER_H) -> float:
    a, b, c = coefficients
    return a * math.log(T) + b * math.log(T / (T + P)) + c


def choose(T: int, P: int, N: int, shape: ModelShape, cal: Calibration, rule: str = "alg5") -> Decision:
    """pass-KV or pass-Q for a prefill of T new tokens over P cached ones on N ranks."""
    kv_time, q_time = predicted_times(T, P, N, shape, cal)
    kv_ok, t_thr, miss_thr = alg5_prefers_pass_kv(T, P, N, shape, cal)
    if rule == "empirical":
        kv_ok = empirical_h(T, P, cal.h_coefficients) > 0
    elif rule != "alg5":
        raise ValueError(f"planner rule must be 'alg5' or 'empirical', got {rule!r}")
    d = Decision("ring_pass_kv" if kv_ok else "ring_pass_q", rule, T, P, N, kv_time, q_time, t_thr, miss_thr)
    logger.debug("planner: %s", d)
    return d


def fit_h(samples) -> tuple[float, float, float]:
    """Refit App. D's h(T,P) from measured timings.

    samples: iterable of (T, P, time_pass_kv, time_pass_q). Least squares of log(t_q / t_kv)
    (positive where pass-KV is faster) on [log T, log(T/(T+P)), 1]; the sign of h then picks.
    """
    import torch

    rows, target = [], []
    for T, P, t_kv, t_q in samples:
        rows.append([math.log(T), math.log(T / (T + P)), 1.0])
        target.append(math.log(t_q / t_kv))
    if len(rows) < 3:
        raise ValueError("fit_h needs at least 3 measurements")
    sol = torch.linalg.lstsq(torch.tensor(rows, dtype=torch.float64), torch.tensor(target, dtype=torch.float64)[:, None])
    a, b, c = sol.solution.flatten().tolist()
    return a, b, c
