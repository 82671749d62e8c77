"""The benchmark end to end at tiny sizes (N=2, then N=1 into the same directory), and the cost model.

This file holds the checks that launch ranks (tests/launch.py); the others, and the feature's whole description, are in
tests/unit/test_bench.py.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from areas import ROOT  # the repository root
from launch import launch, python, worker_path

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
    results = launch(n, [worker_path("torch_ring_worker.py")], timeout=300)
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


def test_comm_wait_accounting():
    """Comm charges blocked time to stats.waits: a late peer shows up as exposed wait, a finished one does not."""
    results = launch(2, [worker_path("bench_comm_worker.py")], timeout=120)
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
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
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
