"""The benchmark end to end at tiny sizes (N=2, then N=1 into the same directory), and the cost model."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from launch import launch, python  # noqa: E402

from hf_contextpar.plan import costmodel  # noqa: E402
from hf_contextpar.plan.machine import Machine  # noqa: E402

ROW_FIELDS = [
    "kind",
    "strategy",
    "N",
    "run_N",
    "length",
    "threads_per_rank",
    "ttft_s",
    "ttft_s_per_rank",
    "ttft_all_s",
    "ttit_s",
    "ttit_all_s",
    "kv_bytes_per_rank",
    "peak_bytes_per_rank",
    "peak_delta_bytes_per_rank",
    "bytes_sent_per_rank",
    "bytes_received_per_rank",
    "comm_wait_s_per_rank",
    "decode_comm_wait_s_per_rank",
    "comm_wait_frac",
    "comm_wait_by_op_s_per_rank",
    "ttft_cpu_s_per_rank",
    "predicted_ttft_s",
    "speedup_vs_unpatched",
    "speedup_vs_unpatched_all_cores",
    "cpu_speedup_vs_unpatched",
    "ttit_ratio_vs_unpatched",
    "decode_overhead_s",
    "tokens",
    "tokens_match_unpatched",
    "kv_bound_bytes",
    "kv_within_bound",
]
RUN_FIELDS = [
    "N",
    "threads_per_rank",
    "cores",
    "model",
    "machine",
    "small_collective_s",
    "decode_floor_s",
    "shape",
    "skipped",
    "lengths",
]
# tiny-llama: 2 layers, 4 query heads, 2 KV heads, head_dim 16, vocab 384, fp32
LAYERS, KV_HEADS, HEAD_DIM, VOCAB = 2, 2, 16, 384


def _bench(tmp_path, n, extra=()):
    args = [
        "-m",
        "hf_contextpar.bench",
        "--model",
        "tiny-llama",
        "--lengths",
        "64,128",
        "--repeats",
        "1",
        "--new-tokens",
        "3",
        "--out",
        str(tmp_path),
        *extra,
    ]
    if n == 1:
        env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
        res = python(args, env=env, timeout=300)
        results = [(res.returncode, res.stdout, res.stderr)]
    else:
        results = launch(n, args, timeout=300)
    for rank, (rc, _, err) in enumerate(results):
        assert rc == 0, f"rank {rank} exited {rc}:\n{err[-4000:]}"
    return results[0][1], json.load(open(tmp_path / "bench.json"))


def test_bench_gloo_rows(tmp_path):
    """--gloo-rows: each strategy also runs with shared memory off, in the same rounds, its decode
    target judged against gloo's floor. --csa (issue 41): the approximate rows of their own kind beside
    ring_pass_kv in the same rounds, each rank's TTFT and bytes sent, no targets, no '+gloo' twin."""
    from hf_contextpar.tools.bench.report import check_targets

    extra = ["--strategies", "ring_pass_kv", "--gloo-rows", "--peers", "none", "--csa", "0.5", "--topology", "1x2"]
    stdout, report = _bench(tmp_path, 2, extra)
    rows = {(r["strategy"], r["length"]): r for r in report["rows"] if r["kind"] == "cp"}
    assert set(rows) == {(s, t) for s in ("ring_pass_kv", "ring_pass_kv+gloo") for t in (64, 128)}
    assert all(r["tokens_match_unpatched"] for r in rows.values())
    run = report["runs"]["2"]
    floors = {t: f"{LAYERS * run['small_collective_by_transport'][t] * 1e3:.2f} ms" for t in ("shm", "gloo")}
    decode = {t["target"].split()[1]: t["target"] for t in check_targets(report) if t["target"].startswith("decode")}
    assert floors["shm"] in decode["ring_pass_kv"] and floors["gloo"] in decode["ring_pass_kv+gloo"], (floors, decode)
    csa = {r["length"]: r for r in report["rows"] if r["kind"] == "csa"}
    assert set(csa) == {64, 128} and run["csa"] == "CSA(topology=1x2, keep L2=0.5, observe=64)"
    for t, r in csa.items():
        ring = rows["ring_pass_kv", t]
        assert r["approximate"] and r["rival"] == "ring_pass_kv" and r["predicted_ttft_s"] is None
        assert r["rival_ttft_s_per_rank"] == ring["ttft_s_per_rank"] and len(r["ttft_s_per_rank"]) == 2
        assert r["rival_bytes_sent_per_rank"] == ring["bytes_sent_per_rank"]
        # the chain: rank 0 sends its block down, rank 1 (the last) sends no K/V; the ring sends both ways
        assert r["bytes_sent_per_rank"][1] < r["bytes_sent_per_rank"][0] and r["bytes_ratio_vs_rival"] < 1
    assert not any(t["target"].startswith(("prefill csa", "decode csa")) for t in report["targets"])
    assert "## CSA (APPROXIMATE) beside exact ring pass-KV" in stdout and "| csa (APPROXIMATE) | 2 |" in stdout


def test_bench_end_to_end(tmp_path):
    from hf_contextpar.api import STRATEGIES

    stdout, report = _bench(tmp_path, 2)
    run = report["runs"]["2"]
    assert all(k in run for k in RUN_FIELDS), set(RUN_FIELDS) - set(run)
    assert run["small_collective_s"] > 0 and run["decode_floor_s"] == pytest.approx(LAYERS * run["small_collective_s"])
    assert run["transport"] == "shm" and set(run["small_collective_by_transport"]) == {"shm", "gloo"}
    assert run["small_collective_s"] == run["small_collective_by_transport"]["shm"]
    skipped = {s["strategy"] for s in run["skipped"]}
    ran = [s for s in STRATEGIES if s != "auto" and s not in skipped]
    assert "ring_pass_kv" in ran
    rows = report["rows"]
    for r in (r for r in rows if r["kind"] != "peer"):
        missing = [k for k in ROW_FIELDS if k not in r]
        assert not missing, (r["strategy"], missing)
    cp = [r for r in rows if r["kind"] == "cp"]
    assert sorted((r["strategy"], r["length"]) for r in cp) == sorted((s, t) for s in ran for t in (64, 128))
    assert {r["strategy"] for r in rows if r["kind"] == "baseline"} <= {"unpatched", "unpatched_all_cores"}
    for r in cp:
        assert r["N"] == 2 and len(r["kv_bytes_per_rank"]) == 2 and len(r["tokens"]) == 3
        assert r["tokens_match_unpatched"], r["strategy"]  # the benchmark checks exactness too
        assert r["kv_within_bound"], (r["kv_bytes_per_rank"], r["kv_bound_bytes"])
        assert all(0 < w < r["ttft_s"] for w in r["comm_wait_s_per_rank"])
        assert r["predicted_ttft_s"] is None or r["predicted_ttft_s"] > 0
    for r in (r for r in cp if r["strategy"] == "ring_pass_kv"):
        # each rank sends its own KV block (KV heads only, never repeated) once per layer, plus the input
        # check (8 int64) and the gathered last-token logits
        kv_block = LAYERS * (r["length"] // 2) * 2 * KV_HEADS * HEAD_DIM * 4
        for sent in r["bytes_sent_per_rank"]:
            assert kv_block <= sent <= kv_block + 8 * 8 + VOCAB * 4
    for name in ("bench.md", *report["plots"]):
        assert (tmp_path / name).stat().st_size > 0
    assert set(report["plots"]) == {"ttft.png", "speedup.png", "kv_memory.png"}
    assert open(tmp_path / "ttft.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert "| ring_pass_kv | 2 |" in stdout and "## Targets" in stdout
    assert any("exposed communication ring_pass_kv N=2" in t["target"] for t in report["targets"])
    _check_peer_rows(report, stdout, 2)

    # an N=1 run into the same directory adds its rows and keeps the N=2 ones
    _, merged = _bench(tmp_path, 1)
    assert set(merged["runs"]) == {"1", "2"}
    assert {r["run_N"] for r in merged["rows"]} == {1, 2}
    assert len([r for r in merged["rows"] if r["run_N"] == 2]) == len(rows)
    one = [r for r in merged["rows"] if r["run_N"] == 1 and r["kind"] == "cp"]
    assert one and all(r["bytes_sent_per_rank"] == [0] and r["tokens_match_unpatched"] for r in one)
    assert any(t["target"].startswith("N=1 patched") for t in merged["targets"])
    _check_peer_rows(merged, "", 1)


def _check_peer_rows(report, stdout, n):
    """PyTorch's ring as peer rows: both rotate methods at every length, logits checked, ours/peer ratio."""
    from hf_contextpar.tools.bench.torch_ring import PEERS

    peers = [r for r in report["rows"] if r["kind"] == "peer" and r["run_N"] == n]
    assert sorted((r["strategy"], r["length"]) for r in peers) == sorted((p, t) for p in PEERS for t in (64, 128))
    for r in peers:
        assert r["N"] == n and len(r["bytes_sent_per_rank"]) == n and r["ttit_s"] is None
        assert r["logits_ok"] and 0 <= r["logits_max_abs_diff"] <= r["logits_tolerance"] == 1e-4
        assert r["tokens_match_unpatched"] and len(r["tokens"]) == 1
        assert r["rival"] == "ring_pass_kv" and r["ttft_ratio_ours_over_peer"] > 0
        # the ring's K/V payload: unrepeated KV heads, (N-1) blocks of T/N tokens per layer
        kv_block = LAYERS * (r["length"] // n) * 2 * KV_HEADS * HEAD_DIM * 4
        assert r["bytes_sent_per_rank"] == [(n - 1) * kv_block] * n
        target = next(t for t in report["targets"] if t["target"].startswith(f"peer {r['strategy']} N={n}: logits"))
        assert target["met"]
    if n > 1:
        assert "## Peer: PyTorch's ring attention" in stdout and "| torch_ring_alltoall | 2 | 128 |" in stdout
        assert any(
            t["target"].startswith("ring_pass_kv no slower than torch_ring_allgather") for t in report["targets"]
        )


@pytest.mark.parametrize("n", [2, 3])
def test_torch_ring_peer_exact(n):
    """The peer computes what the unpatched model computes (N=3: the load balancer takes any N with 2N | T),
    so its row cannot time a wrong computation; it sends unrepeated KV heads and restores the model."""
    results = launch(n, [os.path.join(os.path.dirname(__file__), "torch_ring_worker.py")], timeout=300)
    for rank, (rc, _, err) in enumerate(results):
        assert rc == 0, f"rank {rank} exited {rc}:\n{err[-4000:]}"
    for _, out, _ in results:
        records = json.loads(out.strip().splitlines()[-1])
        *cases, refused = records
        assert len(cases) == 4 and "multiple of 2N" in refused["error"]
        for c in cases:
            assert c["shape"] == [1, c["T"], VOCAB] and c["max_abs_diff"] < 1e-4, c
            assert c["token"] == c["ref_token"] and c["attn"] == "sdpa", c
            assert c["bytes_sent"] == (n - 1) * LAYERS * (c["T"] // n) * 2 * KV_HEADS * HEAD_DIM * 4, c


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


def test_comm_wait_accounting():
    """Comm charges blocked time to stats.waits: a late peer shows up as exposed wait, a finished one does not."""
    results = launch(2, [os.path.join(os.path.dirname(__file__), "bench_comm_worker.py")], timeout=120)
    for rank, (rc, _, err) in enumerate(results):
        assert rc == 0, f"rank {rank} exited {rc}:\n{err[-3000:]}"
    r0, r1 = (json.loads(out.strip().splitlines()[-1]) for _, out, _ in results)
    assert r0["ring_ok"] and r1["ring_ok"]
    assert r0["ring_wait"] >= 0.2, r0  # waited for the late rank 1
    assert r1["ring_wait"] < 0.2, r1  # rank 0's block was already there
    for r in (r0, r1):
        assert r["async_ok"], r
        assert r["async_stats"] == [16, 16, 1]  # two int64 each way, one call
        assert r["async_wait"] < 0.15 and r["async_wait_call_s"] < 0.15, r


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


def test_simulated_ranks_on_the_fake_group(tmp_path):
    """dev/gpu/simulated_ranks.py (the one-GPU model-level figures) on CPU: each rank of N = 2 runs alone on
    torch's fake process group, whose all-gather must hand back this rank's tensor (else the script stops):
    rank 0 and rank 1 each hold half the KV cache, the prefill ran a prefill strategy and sent its blocks,
    decode ran, and the docs' table renders from the JSON."""
    import subprocess

    from dev.gpu.simulated_ranks import markdown

    out = tmp_path / "sim.json"
    args = ["--geometry", "tiny", "--lengths", "301", "--worlds", "2", "--dtype", "fp32", "--repeats", "1"]
    cmd = [sys.executable, "-m", "dev.gpu.simulated_ranks", *args, "--new-tokens", "3", "--json", str(out)]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(__file__))
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert [r["rank"] for r in row["ranks"]] == [0, 1]
    one = row["one"]["kv_bytes"]
    for r in row["ranks"]:
        assert abs(r["kv_bytes"] - one / 2) <= one / 301, r  # 150 or 151 of 301 tokens
        assert r["algorithms"]["replicated_decode"] == 2 and r["bytes_sent"] > 0
        assert set(r["algorithms"]) - {"replicated_decode"}, r  # and a prefill strategy
    assert row["prefill_speedup"] > 0 and row["ttit_ratio"] > 0
    assert "| 301 | 2 |" in markdown(report)
