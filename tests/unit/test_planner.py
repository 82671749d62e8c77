"""The pass-KV / pass-Q planner: the cost-model rule, Alg. 5 boundaries, h(T,P), calibration I/O.

This file holds the checks that run in the pytest process; the ones that launch ranks are in tests/multi_process/test_planner.py.
"""

from __future__ import annotations

import math

import pytest

from hf_contextpar.model.shape import model_shape
from hf_contextpar.plan.choice import Calibration, alg5_prefers_pass_kv, choose, empirical_h, fit_h
from hf_contextpar.plan.costmodel import Shape, attention_flops, predict_ttft, ring_attention_times

SHAPE = Shape(layers=1, heads=8, kv_heads=1, head_dim=64, linear_weights=0, elem_bytes=2)  # 2 N_KV / N_H = 0.25
CAL = Calibration(attn_flops=1e12, bandwidth=1e9)
N = 4


def test_alg5_threshold_on_T():
    t_thr = N * CAL.attn_flops * SHAPE.kv_heads * SHAPE.elem_bytes / (2 * SHAPE.heads * CAL.bandwidth)
    assert t_thr == 500.0
    # at and above the threshold pass-KV wins at any miss rate, however large the cache
    assert alg5_prefers_pass_kv(500, 10**9, N, SHAPE, CAL)[0]
    assert choose(501, 10**9, N, SHAPE, CAL, "alg5").strategy == "ring_pass_kv"


def test_alg5_threshold_on_miss_rate():
    T = 100  # below the T threshold: the miss rate decides
    miss_thr = 2 * 1 / 8 - 4 * T * CAL.bandwidth / (N * CAL.attn_flops * 2)
    assert math.isclose(miss_thr, 0.25 - 0.05)
    P_at = round(T / miss_thr) - T  # T/(T+P) == 0.2 exactly
    assert choose(T, P_at, N, SHAPE, CAL, "alg5").strategy == "ring_pass_kv"
    assert choose(T, P_at + 1, N, SHAPE, CAL, "alg5").strategy == "ring_pass_q"
    assert choose(T, P_at - 1, N, SHAPE, CAL, "alg5").strategy == "ring_pass_kv"


def test_attention_flops_match_the_paper():
    """App. A: a fresh prompt costs 1/2 * 4 * T^2 * D (causal); over P cached tokens each new token
    also sees all P keys. One formula serves the planner and the TTFT prediction."""
    T, P, D = 1000, 3000, 8 * 64
    assert attention_flops(T, SHAPE) == 0.5 * 4 * T * T * D
    assert attention_flops(T, SHAPE, P) == 4 * T * P * D + 0.5 * 4 * T * T * D
    kv, q = ring_attention_times(T, 0, N, SHAPE, CAL)
    full = predict_ttft("ring_pass_kv", T, N, SHAPE, CAL)  # no linear weights: attention only
    assert math.isclose(full, kv)


def test_ring_times_hand_computed():
    T, P = 1000, 3000
    c = 4 * 8 * 64 * T * (P + T / 2) / (N * N * 1e12)  # 4.48e-4 s per ring step
    m_kv = 2 * (T + P) / N * 1 * 64 * 2 / 1e9  # 2.56e-4 s
    m_q = T / N * 8 * 64 * 2 / 1e9  # 2.56e-4 s
    a2a = (N - 1) * T / N * 8 * 65 * 4 / 1e9
    kv, q = ring_attention_times(T, P, N, SHAPE, CAL)
    assert math.isclose(kv, 3 * max(c, m_kv) + c) and math.isclose(q, 3 * max(c, m_q) + c + a2a)
    assert kv < q  # both rings hidden under compute, pass-Q pays the All2All


def test_cost_rule_picks_the_lower_prediction():
    """The default rule: whichever of the two ring times the cost model predicts lower."""
    slow_net = Calibration(attn_flops=1e15, bandwidth=1e8)  # communication-bound: message sizes decide
    for T, P in ((64, 0), (64, 64), (8, 100000), (2048, 2048), (1, 10**6)):
        d = choose(T, P, N, SHAPE, slow_net)
        kv, q = ring_attention_times(T, P, N, SHAPE, slow_net)
        assert d.rule == "cost" and d.strategy == ("ring_pass_kv" if kv <= q else "ring_pass_q")
    # a few new tokens over a long cache: Q is far smaller than the cache's KV
    assert choose(8, 100000, N, SHAPE, slow_net).strategy == "ring_pass_q"
    assert choose(4096, 0, N, SHAPE, slow_net).strategy == "ring_pass_kv"


def test_empirical_h_paper_and_refit():
    # the paper's fit: long prompts with a high miss rate -> pass-KV; short over a huge cache -> pass-Q
    assert empirical_h(8192, 0) > 0  # full prefill: pass-KV
    assert empirical_h(128, 128 * 1000) < 0 and empirical_h(4096, 4096) > 0
    truth = (-0.7, 1.3, 4.0)
    samples = []
    for T in (64, 256, 1024, 4096):
        for P in (0, T, 10 * T, 100 * T):
            ratio = math.exp(empirical_h(T, P, truth))  # t_q / t_kv
            samples.append((T, P, 1.0, ratio))
    assert all(math.isclose(a, b, abs_tol=1e-9) for a, b in zip(fit_h(samples), truth))


def test_calibration_roundtrip_and_resolution(tmp_path, monkeypatch):
    path = tmp_path / "cal.json"
    Calibration(attn_flops=3e10, bandwidth=2e9, source="measured").save(str(path))
    assert Calibration.load(str(path)).attn_flops == 3e10
    monkeypatch.setenv("HF_CONTEXTPAR_CALIBRATION", str(path))
    assert Calibration.resolve().bandwidth == 2e9  # the saved file wins over defaults
    monkeypatch.setenv("HF_CONTEXTPAR_CALIBRATION", str(tmp_path / "missing.json"))
    assert Calibration.resolve().source == "default"
    with pytest.raises(FileNotFoundError, match="calibrate"):
        Calibration.resolve(str(tmp_path / "nope.json"))


def test_mla_pass_kv_moves_the_latent():
    """An MLA model's pass-KV carries one cached latent + RoPE part per token, not per-head K/V: the cost
    model and Alg. 5 see a GQA model of (latent + rope) / (2 qk_head_dim) KV heads (issue 32)."""
    from hf_contextpar.models import tiny_model

    model = tiny_model("deepseek_v3")
    shape, cfg = model_shape(model), model.config
    assert shape.kv_token_bytes == (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    assert shape.kv_heads_equivalent == pytest.approx((cfg.kv_lora_rank + cfg.qk_rope_head_dim) / (2 * 192))
    expanded = Shape(shape.layers, shape.heads, shape.kv_heads, shape.head_dim, shape.linear_weights, 4)
    assert ring_attention_times(8192, 0, N, shape, CAL)[0] < ring_attention_times(8192, 0, N, expanded, CAL)[0]
