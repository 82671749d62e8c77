"""The benchmark end to end at tiny sizes (N=2, then N=1 into the same directory), and the cost model.

This file holds the checks that run in the pytest process; the ones that launch ranks are in tests/multi_process/test_bench.py.
"""

from __future__ import annotations

import json
import math
import sys

import pytest

from hf_contextpar.plan import costmodel
from hf_contextpar.plan.machine import Machine


@pytest.mark.parametrize("broken", ["symbol", "module"])
def test_torch_ring_peer_skipped_with_note(broken, tmp_path, monkeypatch, capsys):
    """A torch without PyTorch's ring (a symbol gone, or the module) skips the peer rows with the reason."""
    from hf_contextpar.tools.bench import main, torch_ring

    if broken == "symbol":
        mod = torch_ring._torch_cp()
        monkeypatch.delattr(mod, "_templated_ring_attention")
        reason = "lacks _templated_ring_attention"
    else:
        monkeypatch.setitem(sys.modules, torch_ring._MODULE, None)  # import raises ImportError
        reason = "unavailable"
    assert reason in torch_ring.unavailable()
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    args = ["--model", "tiny-llama", "--lengths", "32", "--repeats", "1", "--new-tokens", "2"]
    main([*args, "--strategies", "ring_pass_kv", "--threads", "1", "--no-plots", "--out", str(tmp_path)])
    stdout = capsys.readouterr().out
    report = json.load(open(tmp_path / "bench.json"))
    notes = {s["strategy"]: s["reason"] for s in report["runs"]["1"]["skipped"]}
    assert set(notes) == set(torch_ring.PEERS) and all(reason in r for r in notes.values())
    assert "skipped torch_ring_allgather: PyTorch ring attention unavailable" in stdout
    assert not [r for r in report["rows"] if r["kind"] == "peer"]


def test_torch_ring_peer_skipped_for_a_model_with_recurrent_layers():
    """PyTorch's ring shards attention alone: on a hybrid each rank would run its recurrent layers from zero, a
    wrong computation (which fails the run), so the peer rows are skipped with that reason."""
    from types import SimpleNamespace

    from hf_contextpar.tools.bench.run import _peers

    hybrid = SimpleNamespace(config=SimpleNamespace(model_type="qwen3_next"))
    names, skipped = _peers(None, 2, hybrid)
    assert names == [] and skipped and all("state chain" in s["reason"] for s in skipped)
    assert _peers("none", 2, hybrid) == ([], [])
    plain = SimpleNamespace(config=SimpleNamespace(model_type="llama"))
    assert all("state chain" not in s["reason"] for s in _peers(None, 2, plain)[1])


# -- cost model: hand-computed cases ---------------------------------------------------------------
SHAPE = costmodel.Shape(layers=1, heads=2, kv_heads=1, head_dim=4, linear_weights=100, elem_bytes=4)
MACHINE = Machine(attn_flops=1e3, gemm_flops=1e2, bandwidth=1e2, latency=0.5)


def test_costmodel_hand_computed():
    # T=8: causal attention FLOPs 4*2*4*8*8/2 = 1024; linear 2*100*T/N/100
    assert costmodel.attention_flops(8, SHAPE) == 1024
    assert costmodel.predict_ttft("ring_pass_kv", 8, 1, SHAPE, MACHINE) == pytest.approx(16 + 1.024)
    # N=2: linear 8; a = 1024/2/1000 = 0.512, a/N = 0.256; KV message 0.5 + 2*4*1*4*4/100 = 1.78 (exposed)
    # attention (N-1)*max(0.256, 1.78) + 0.256 = 2.036; plus 2 per-forward collectives of 0.5
    assert costmodel.predict_ttft("ring_pass_kv", 8, 2, SHAPE, MACHINE) == pytest.approx(8 + 2.036 + 1.0)
    # pass-Q: Q message 0.5 + 4*2*4*4/100 = 1.78; All2All 0.5 + 1*4*2*5*4/100 = 2.1
    assert costmodel.predict_ttft("ring_pass_q", 8, 2, SHAPE, MACHINE) == pytest.approx(8 + 1.78 + 0.256 + 2.1 + 1.0)
    # all-gather KV: 0.5 + 1*4*2*1*4*4/100 = 1.78, then the whole share 0.512
    assert costmodel.predict_ttft("allgather_kv", 8, 2, SHAPE, MACHINE) == pytest.approx(8 + 1.78 + 0.512 + 1.0)
    # KV-Runahead on balanced partitions: every rank the even share a/N = 0.512, one hop of 4 tokens' KV:
    # 0.5 + 2*4*1*4*4/100 = 1.78
    assert costmodel.predict_ttft("kv_runahead", 8, 2, SHAPE, MACHINE) == pytest.approx(8 + 0.512 + 1.78 + 1.0)
    # Ulysses moves whole heads: not with 1 KV head on 2 ranks; with 2: QKV in 1/2*4*(2+2*2)*4*4/100 = 1.92,
    # O out 1/2*4*2*4*4/100 = 0.64, two latencies
    assert costmodel.predict_ttft("ulysses", 8, 2, SHAPE, MACHINE) is None
    two_kv = costmodel.Shape(layers=1, heads=2, kv_heads=2, head_dim=4, linear_weights=100, elem_bytes=4)
    assert costmodel.predict_ttft("ulysses", 8, 2, two_kv, MACHINE) == pytest.approx(
        8 + 1.0 + 1.92 + 0.64 + 0.512 + 1.0
    )
    assert costmodel.predict_ttft("no_such_strategy", 8, 2, SHAPE, MACHINE) is None
    # exposed communication: everything above the same prediction with free communication (8 + 0.512)
    free_comm = Machine(attn_flops=1e3, gemm_flops=1e2)
    exposed = costmodel.predict_ttft("ring_pass_kv", 8, 2, SHAPE, MACHINE) - costmodel.predict_ttft(
        "ring_pass_kv", 8, 2, SHAPE, free_comm
    )
    assert exposed == pytest.approx(11.036 - 8.512)


def test_costmodel_overlap_and_scaling():
    free = Machine(attn_flops=1e3, gemm_flops=1e2)  # infinite bandwidth, no latency
    for n in (2, 3, 4):
        one = costmodel.predict_ttft("ring_pass_kv", 4096, 1, SHAPE, free)
        assert costmodel.predict_ttft("ring_pass_kv", 4096, n, SHAPE, free) == pytest.approx(one / n)
    # compute-bound ring: the KV message hides under a/N, so bandwidth drops out entirely
    slow_net = Machine(attn_flops=1e3, gemm_flops=1e2, bandwidth=1e6, latency=0.0)
    T = 4096  # a/N = 4*2*4*T*T/2/2/2/1e3 = 67109 s >> message 2*2048*1*4*4/1e6 = 0.066 s
    assert costmodel.predict_ttft("ring_pass_kv", T, 2, SHAPE, slow_net) == pytest.approx(
        costmodel.predict_ttft("ring_pass_kv", T, 2, SHAPE, free)
    )
    assert not math.isnan(costmodel.predict_ttft("ring_pass_q", T, 2, SHAPE, slow_net))


def test_costmodel_shape_from_model():
    from hf_contextpar.model.shape import model_shape
    from hf_contextpar.models import tiny_model

    shape = model_shape(tiny_model("llama"))
    # q, o: 64x64; k, v: 64x32; gate, up, down: 64x128
    assert shape == costmodel.Shape(
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=16,
        linear_weights=2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128,
        elem_bytes=4,
    )


def test_torch_ring_peer_wrong_logits_fail_loudly(tmp_path, monkeypatch, capsys):
    """A peer row beyond tolerance is marked FAILED in the written report and the run exits non-zero
    (here on one process, with a tolerance no logits can meet)."""
    import importlib

    import torch

    from hf_contextpar.tools.bench import main

    monkeypatch.setattr(
        importlib.import_module("hf_contextpar.tools.bench.run"), "PEER_TOLERANCE", {torch.float32: -1.0}
    )
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    args = ["--model", "tiny-llama", "--lengths", "32", "--repeats", "1", "--new-tokens", "2", "--threads", "1"]
    with pytest.raises(SystemExit, match="computed logits beyond tolerance"):
        main(
            [
                *args,
                "--strategies",
                "ring_pass_kv",
                "--peers",
                "torch_ring_allgather",
                "--no-plots",
                "--out",
                str(tmp_path),
            ]
        )
    report = json.load(open(tmp_path / "bench.json"))
    (row,) = [r for r in report["rows"] if r["kind"] == "peer"]
    assert row["strategy"] == "torch_ring_allgather" and not row["logits_ok"] and row["logits_max_abs_diff"] == 0.0
    assert "**FAILED**" in capsys.readouterr().out
    assert not next(t for t in report["targets"] if "logits within" in t["target"])["met"]


def test_kv_bytes_counts_the_indexer_keys_on_one_process():
    """The bench's KV bound compares a rank's cache with one process's: with indexed attention (DSA) both
    sides must count the indexer's keys (transformers keeps them beside K/V, `update_indexer`), or a rank
    holding half of them reads as over the bound (16K, N = 2: 44 MiB against 72 / 2)."""
    import torch

    from hf_contextpar.models import tiny_model
    from hf_contextpar.tools.bench.measure import kv_bytes

    model = tiny_model("deepseek_v32", dtype=torch.float32)
    c = model.config
    T = 40
    with torch.no_grad():
        cache = model(torch.randint(0, 200, (1, T)), use_cache=True).past_key_values
    latent = T * (c.kv_lora_rank + c.qk_rope_head_dim) * 4
    indexer = T * c.index_head_dim * 4
    k, v = cache.layers[0].keys, cache.layers[0].values
    assert k.nbytes + v.nbytes == latent  # the latent K/V (values empty): what the bench counted before
    assert kv_bytes(cache) == c.num_hidden_layers * (latent + indexer)


def test_comm_stats_count_received_bytes_per_operation():
    """The bench reports the indexer's keys apart (op index_keys): CommStats counts received bytes per op."""
    from hf_contextpar.comm.collectives import CommStats
    from hf_contextpar.tools.bench.report import _index_key_lines

    s = CommStats()
    s.record("ring_shift", 10, 30)
    s.record("index_keys", 0, 12)
    s.record("index_keys", 0, 8)
    assert s.received_by_op == {"ring_shift": 30, "index_keys": 20} and s.bytes_received == 50
    row = dict(strategy="ring_pass_kv", N=2, length=16, bytes_received_per_rank=[50, 40])
    row["bytes_received_by_op_per_rank"] = [dict(s.received_by_op), {"index_keys": 10}]
    assert "(40% of its bytes)" in _index_key_lines([row])[1]
    assert _index_key_lines([dict(row, bytes_received_by_op_per_rank=[{"ring_shift": 30}])]) == []
    s.reset()
    assert s.received_by_op == {}
