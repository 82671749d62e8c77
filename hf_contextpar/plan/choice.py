"""Choosing ring pass-KV or ring pass-Q for each prefill call (Meta CP paper 3.4, Alg. 1/5, App. D).

The default rule ("cost") picks the strategy with the lower predicted time from the one cost
model (each record's `time` formula, `costmodel.model_time`: per rank, summed over layers, the causal attention of T new tokens
over P cached ones, each ring step's message overlapped with one step's compute, and pass-Q's
All2All home). The paper's rules stay available as planner_rule:
- "alg5": Meta Alg. 5 (Table 3's roofline, which counts the new x new block in full): pass-KV iff
      T >= N C N_KV e / (2 N_H BW)   or   T/(T+P) >= 2 N_KV/N_H - 4 T BW / (N C e);
- "empirical": App. D's h(T,P) = a log T + b log(T/(T+P)) + c, pass-KV iff h > 0, with
  coefficients refit from measured timings by `fit_h`.
C and BW are machine facts: `python -m hf_contextpar calibrate` measures them and saves them;
without a calibration file the defaults in `machine.DEFAULTS` are used. Every rank uses rank
0's calibration (agreed in `apply_context_parallel`), so every rank chooses the same.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from .costmodel import Shape, model_time
from .machine import PAPER_H, Machine
from .strategies import STRATEGIES

logger = logging.getLogger(__name__)

Calibration = Machine  # the planner's name for the machine facts it reads (C, BW, h coefficients)
RULES = ("cost", "alg5", "empirical")


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


def alg5_prefers_pass_kv(T: int, P: int, N: int, shape: Shape, cal: Machine) -> tuple[bool, float, float]:
    """Meta Alg. 5; also returns its two thresholds (on T, and on the miss rate T/(T+P))."""
    h, kv, e = shape.heads, shape.kv_heads_equivalent, shape.elem_bytes
    t_threshold = N * cal.attn_flops * kv * e / (2 * h * cal.bandwidth)
    miss_threshold = 2 * kv / h - 4 * T * cal.bandwidth / (N * cal.attn_flops * e)
    return T >= t_threshold or T / (T + P) >= miss_threshold, t_threshold, miss_threshold


def empirical_h(T: int, P: int, coefficients=PAPER_H) -> float:
    a, b, c = coefficients
    return a * math.log(T) + b * math.log(T / (T + P)) + c


def choose(T: int, P: int, N: int, shape: Shape, cal: Machine, rule: str = "cost", candidates=None) -> Decision:
    """Of the candidates (strategy records; by default those strategy="auto" weighs on a model without recurrent
    layers or an indexer: ring pass-KV and ring pass-Q), the one for a prefill of T new tokens over P cached ones on
    N ranks. "cost": the least predicted time, each candidate's `time` formula summed over the model's layers (the
    first registered on a tie); the paper's rules ("alg5", "empirical") say whether pass-KV wins, i.e. the candidate
    that moves K/V rather than queries."""
    if rule not in RULES:
        raise ValueError(f"planner rule must be one of {RULES}, got {rule!r}")
    if candidates is None:
        candidates = [s for s in STRATEGIES.values() if s.prefill and s.auto and not s.approximate and not s.contiguous]
    times = {s.name: model_time(s, T, P, N, shape, cal) for s in candidates}
    kv = next(s.name for s in candidates if not s.moves_queries)  # the paper's pass-KV: its K/V travel
    q = next(s.name for s in candidates if s.moves_queries)  # the paper's pass-Q: its queries travel
    kv_ok, t_thr, miss_thr = alg5_prefers_pass_kv(T, P, N, shape, cal)
    if rule == "empirical":
        kv_ok = empirical_h(T, P, cal.h_coefficients) > 0
    if rule == "cost":
        strategy = min((name for name in times if times[name] is not None), key=times.get)
    else:
        strategy = kv if kv_ok else q
    d = Decision(strategy, rule, T, P, N, times[kv], times[q], t_thr, miss_thr)
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
    sol = torch.linalg.lstsq(
        torch.tensor(rows, dtype=torch.float64), torch.tensor(target, dtype=torch.float64)[:, None]
    )
    a, b, c = sol.solution.flatten().tolist()
    return a, b, c
