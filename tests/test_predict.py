"""`python -m hf_contextpar predict`: the cost model on paper, for any model and machine."""

import json
import subprocess
import sys

import pytest

from hf_contextpar.costmodel import Machine, predict_ttft
from hf_contextpar.planner import choose
from hf_contextpar.tools.predict import (
    PRESETS,
    kv_bytes_per_rank,
    pass_q_threshold,
    predict_ttit,
    report,
    shape_of,
    traffic_per_rank,
)


def test_shape_of_a_published_geometry_with_tensor_parallelism():
    s = shape_of("llama-3.1-70b", 2, tp=8)
    assert (s.layers, s.heads, s.kv_heads, s.head_dim, s.elem_bytes) == (80, 8, 1, 128, 2)
    # q, o: 8192 x 8192; k, v: 8192 x 1024; gated MLP 3 x 8192 x 28672; divided over 8 GPUs
    assert s.linear_weights == (2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672) // 8


def test_shape_of_a_config_file_and_a_builtin(tmp_path):
    from hf_contextpar.tools.models import tiny_config

    tiny_config("llama").save_pretrained(tmp_path)
    from_file = shape_of(str(tmp_path / "config.json"), 4)
    assert from_file == shape_of("tiny-llama", 4) == shape_of(str(tmp_path), 4)
    assert (from_file.heads, from_file.kv_heads, from_file.head_dim) == (4, 2, 16)


def test_kv_and_traffic_formulas():
    s = shape_of("llama-3.1-8b", 2)
    assert kv_bytes_per_rank(1024, 4, s) == 32 * 2 * 256 * 8 * 128 * 2
    # ring pass-KV and all-gather: every rank's K/V reaches the N-1 others
    assert (
        traffic_per_rank("ring_pass_kv", 1024, 0, 4, s)
        == traffic_per_rank("allgather_kv", 1024, 0, 4, s)
        == 32 * 3 * 2 * 256 * 8 * 128 * 2
    )
    # KV-Runahead: half of that on average (KVR Eq. 7: (N-1)/2 C rows in all), fresh prompts only
    assert traffic_per_rank("kv_runahead", 1024, 0, 4, s) == traffic_per_rank("ring_pass_kv", 1024, 0, 4, s) / 2
    assert traffic_per_rank("kv_runahead", 1024, 10, 4, s) is None


def test_scaling_auto_choice_and_pass_q_threshold():
    s, m = shape_of("llama-3.1-70b", 2, tp=8), PRESETS["h100-rdma"]
    one = predict_ttft("ring_pass_kv", 131072, 1, s, m)
    eight = predict_ttft("ring_pass_kv", 131072, 8, s, m)
    assert 7.0 < one / eight <= 8.0  # compute-bound long prefill: near-linear (Meta: 93% at 1M)
    # pass-Q wins only for few new tokens over a long cache, and the reported threshold is where it flips
    q = pass_q_threshold(131072, 8, s, m)
    assert q is not None and q < 0.5
    T = round(q * 131072)
    assert choose(T, 131072 - T, 8, s, m).strategy == "ring_pass_q"
    assert choose(4 * T, 131072 - 4 * T, 8, s, m).strategy == "ring_pass_kv"
    # decode reads 1/N of the KV cache per rank, plus one collective per layer
    assert predict_ttit(1 << 20, 8, s, m) < predict_ttit(1 << 20, 1, s, m)


def test_report_marks_the_planners_choice():
    text = report("llama-3.1-70b", "h100-tcp", [1, 8], [131072], [1.0, 0.01], tp=8)
    assert "| 8 | 64 | ring_pass_kv |" in text and "<- auto" in text
    assert text.count("<- auto") == 2  # one pick per (context, miss rate) with N > 1


def test_cli_with_a_calibration_file(tmp_path):
    cal = tmp_path / "cal.json"
    Machine(
        attn_flops=2e10, gemm_flops=3e10, bandwidth=1e9, latency=1e-4, memory_bandwidth=1e10, source="measured"
    ).save(str(cal))
    assert json.load(open(cal))["memory_bandwidth"] == 1e10
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "hf_contextpar",
            "predict",
            "--model",
            "tiny-llama",
            "--hardware",
            str(cal),
            "--world",
            "1,2",
            "--lengths",
            "4096",
            "--dtype",
            "float32",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "ring_pass_q" in res.stdout and "measured" in res.stdout


def test_unknown_hardware_is_a_clear_error():
    with pytest.raises(SystemExit, match="--hardware"):
        report("llama-3.1-8b", "tpu-v9", [2], [1024], [1.0])


def test_sliding_layers_count_their_window_only(tmp_path):
    """A sliding layer keeps window - 1 cached tokens and each query sees at most `window` keys:
    KV per rank, traffic, attention time and decode all follow, and `auto` sees it too."""
    from hf_contextpar.costmodel import Shape, attended_keys, attention_flops, config_windows
    from hf_contextpar.tools.models import tiny_config

    # the count of query-key pairs: continuous from P to P + T, capped at the window
    assert attended_keys(1000, 3000) == 1000 * 3500
    assert attended_keys(1000, 3000, 8192) == attended_keys(1000, 3000)  # the window is never reached
    assert attended_keys(1000, 3000, 512) == 1000 * 512  # past the window from the first new token
    assert attended_keys(1000, 0, 400) == 400 * 400 / 2 + 600 * 400  # a triangle, then a band
    for T, P, w in ((700, 300, 512), (50, 480, 512), (4096, 0, 1024)):  # within T of the discrete count
        assert abs(attended_keys(T, P, w) - sum(min(P + i + 1, w) for i in range(T))) <= T

    g = shape_of("gemma-3-27b", 2)
    assert g.window_counts() == {1024: 52, None: 10}
    per_token = 2 * 16 * 128 * 2  # K and V, 16 KV heads x 128, bf16
    assert kv_bytes_per_rank(131072, 8, g) == (10 * 131072 + 52 * 1023) / 8 * per_token
    full = Shape(g.layers, g.heads, g.kv_heads, g.head_dim, g.linear_weights, g.elem_bytes)
    assert kv_bytes_per_rank(131072, 8, full) == 62 * 131072 / 8 * per_token
    # pass-KV over a long cache carries only what each layer kept
    assert traffic_per_rank("ring_pass_kv", 1024, 65536, 4, g) == 3 * (
        10 * 2 * (1024 + 65536) + 52 * 2 * (1024 + 1023)
    ) / 4 * (16 * 128 * 2)
    assert traffic_per_rank("ring_pass_q", 1024, 65536, 4, g) == traffic_per_rank("ring_pass_q", 1024, 65536, 4, full)
    m = PRESETS["h100-nvlink"]
    # Ulysses only where N divides the heads (16 KV heads: 8 ranks yes, 32 no), as apply_context_parallel allows
    assert predict_ttft("ulysses", 131072, 32, g, m) is None and traffic_per_rank("ulysses", 1024, 0, 32, g) is None
    for s in ("ring_pass_kv", "allgather_kv", "ulysses"):
        assert predict_ttft(s, 131072, 8, g, m) < predict_ttft(s, 131072, 8, full, m)
    assert predict_ttit(131072, 8, g, m) < predict_ttit(131072, 8, full, m)
    assert attention_flops(131072, g, 0, 1024) < attention_flops(131072, g) / 60

    # from a config: transformers' own cache decides which layers slide
    gemma3 = tiny_config("gemma3_text")
    assert config_windows(gemma3) == tuple(
        gemma3.sliding_window if t == "sliding_attention" else None for t in gemma3.layer_types
    )
    assert config_windows(tiny_config("llama")) == ()
    gemma3.save_pretrained(tmp_path)
    assert shape_of(str(tmp_path), 4).windows == config_windows(gemma3)
