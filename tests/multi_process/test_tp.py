"""Tensor parallelism inside x context parallelism across (hf_contextpar.mesh, issue 29): TP 2 x CP 2
on 4 gloo processes against the unpatched model on one process, DCP (more TP ranks than KV heads:
TP 4 x CP 1 on 2 KV heads, TP 2 x CP 2 on 1), and the refusals.

This file holds the checks that launch ranks (tests/launch.py); the in-process ones are in tests/unit/test_tp.py.
"""

from __future__ import annotations

import json
import os
import re

import pytest
from launch import launch, matrix, torchrun
from records import tolerance
from tp_worker import DCP, FAMILIES

from hf_contextpar.models import builtin_model_path

# (query, KV) heads each rank's attention receives: qwen2's plan shards them, phi3's gathers its
# fused QKV back (every rank attends with all heads)
HEADS = {"qwen2": [2, 1], "phi3": [4, 4], "qwen3": [2, 1], "qwen2_wide": [4, 2]}
# DCP: each rank attends with its query heads and holds one KV head, shared with one other TP rank
DCP_HEADS = {"qwen2_tp4": [1, 1], "qwen3_tp4": [1, 1], "qwen2_kv1": [2, 1], "qwen3_kv1": [2, 1]}


def results(tmp_path_factory):
    return matrix("tp_worker.py", 4, tmp_path_factory)


def by_case(records):
    return {(r["family"], r["case"]): r for r in records}


@pytest.mark.parametrize("family", FAMILIES)
def test_tp_cp_exact(family, tmp_path_factory):
    """Every strategy, both decode modes and two turns: fp64 logits within the oracle's bound, tokens
    identical, on all 4 ranks; each rank attends with the heads it holds and holds about half the weights."""
    for rank, records in enumerate(results(tmp_path_factory)):
        mine = {case: r for (fam, case), r in by_case(records).items() if fam == family}
        expected = [*FAMILIES[family][1], "ring_pass_q_decode"] + (["two_turns"] if family != "qwen2_wide" else [])
        assert set(expected) <= set(mine), f"rank {rank}: {sorted(mine)}"
        for case in expected:
            r = mine[case]
            assert "error" not in r, f"rank {rank} {family} {case}: {r.get('message')}"
            assert r["max_diff"] <= tolerance(family.split("_")[0], "float64"), f"rank {rank} {family} {case}: {r}"
            assert r["tokens_equal"], f"rank {rank} {family} {case}"
            if "heads" in r:
                assert r["heads"] == HEADS[family], f"rank {rank} {family}: {r['heads']}"
                assert 0.4 < r["weights_held"] < 0.75, f"rank {rank} {family}: holds {r['weights_held']:.2f}"
            if case in FAMILIES[family][1] and case != "auto":
                assert r["algorithms"].get(case) == 2, r["algorithms"]
        if "ring_pass_q_decode" in mine:
            assert mine["ring_pass_q_decode"]["algorithms"].get("ring_pass_q_decode", 0) > 0


def dcp_results(tmp_path_factory):
    return matrix("tp_worker.py", 4, tmp_path_factory, ("dcp",))


@pytest.mark.parametrize("name", DCP)
def test_dcp_exact(name, tmp_path_factory):
    """DCP 2 (TP 4 x CP 1 on 2 KV heads; TP 2 x CP 2 on 1): every strategy, both decode modes, a padded
    batch, two turns and beam search within the oracle's fp64 bound, tokens identical on all 4 ranks; each
    rank's cache holds 1/(cp x dcp) of the tokens within one per layer, and about 1/tp of the weights."""
    tp, _, strategies = DCP[name]
    expected = [*strategies, "two_turns"] + (["ring_pass_q_decode"] if tp < 4 else [])
    expected += ["beam_search", "after_errors"] if name.startswith("qwen2") else []
    for rank, records in enumerate(dcp_results(tmp_path_factory)):
        mine = {case: r for (fam, case), r in by_case(records).items() if fam == name}
        assert set(expected) <= set(mine), f"rank {rank}: {sorted(mine)}"
        for case in expected:
            r = mine[case]
            assert "error" not in r, f"rank {rank} {name} {case}: {r.get('message')}"
            assert r["max_diff"] <= tolerance(name.split("_")[0], "float64"), f"rank {rank} {name} {case}: {r}"
            assert r["tokens_equal"], f"rank {rank} {name} {case}"
            if "heads" in r:
                assert r["heads"] == DCP_HEADS[name], f"rank {rank} {name}: {r['heads']}"
                held, total = r["kv"]
                ways = 4 // tp * 2  # cp x dcp
                assert abs(held - total / ways) <= 1, f"rank {rank} {name} {case}: holds {held} of {total} tokens"
                assert r["weights_held"] < 1.2 / tp, f"rank {rank} {name}: holds {r['weights_held']:.2f}"
            if case in strategies and case != "auto" and tp < 4:
                assert r["algorithms"].get(case) == 2, r["algorithms"]  # the forward and generate()'s prefill
            elif case in strategies and case not in ("auto", "kv_runahead"):  # CP 1: decode steps run it too
                assert set(r["algorithms"]) == {case}, r["algorithms"]
        if "ring_pass_q_decode" in expected:
            assert mine["ring_pass_q_decode"]["algorithms"].get("ring_pass_q_decode", 0) > 0


def test_dcp_refusals_and_fp32(tmp_path_factory):
    """DCP: Ulysses refused at apply, DCP peers given different strategies a RankMismatchError on every rank
    (the model exact after), a fused-QKV plan that cannot hold whole KV heads refused at load; in fp32 the
    tokens of the unpatched model and logits within fp32's bound."""
    for rank, records in enumerate(dcp_results(tmp_path_factory)):
        cases = by_case(records)
        for name in ("qwen2_tp4", "qwen2_kv1"):
            assert cases[(name, "ulysses_refused")].get("error") == "HeadsNotDivisibleError", (rank, name)
            assert cases[(name, "strategy_differs")].get("error") == "RankMismatchError", (rank, name)
            for case in ("ring_pass_q", "auto"):
                r = cases[(f"{name}_fp32", case)]
                assert "error" not in r, f"rank {rank} {name} {case}: {r.get('message')}"
                assert r["tokens_equal"] and r["max_diff"] <= tolerance("qwen2", "float32"), (rank, name, case, r)
        refused = cases[("phi3_kv2", "load")]
        assert refused.get("error") == "HeadsNotDivisibleError" and "k_proj" in refused["message"], (rank, refused)


def test_tp_disagreements_fail_on_every_rank(tmp_path_factory):
    """TP peers given different strategies, or different inputs, while each CP group agrees within
    itself: a RankMismatchError on all 4 ranks (no gloo abort, no hang), and the model runs exactly after."""
    for rank, records in enumerate(results(tmp_path_factory)):
        cases = by_case(records)
        assert cases[("qwen2", "strategy_differs")].get("error") == "RankMismatchError", rank
        assert "tensor-parallel" in cases[("qwen2", "strategy_differs")]["message"]
        assert cases[("qwen2", "inputs_differ")].get("error") == "RankMismatchError", rank
        assert cases[("qwen2", "world_as_cp_group")].get("error") == "UnsupportedModelError", rank
        assert cases[("qwen2", "ulysses_refused")].get("error") == "HeadsNotDivisibleError", rank
        assert cases[("qwen2", "beam_search")].get("tokens_equal") is True, (rank, cases[("qwen2", "beam_search")])
        after = cases[("qwen2", "after_errors")]
        assert "error" not in after and after["tokens_equal"] and after["max_diff"] <= tolerance("qwen2", "float64")


def test_tp_cp_fp32_tokens(tmp_path_factory):
    """fp32: tokens identical to the unpatched fp32 model, logits within fp32's bound."""
    for rank, records in enumerate(results(tmp_path_factory)):
        for case in ("ring_pass_q", "ring_pass_q_decode"):
            r = by_case(records)[("qwen2_fp32", case)]
            assert "error" not in r, f"rank {rank} {case}: {r.get('message')}"
            assert r["tokens_equal"] and r["max_diff"] <= tolerance("qwen2", "float32"), f"rank {rank} {case}: {r}"


def test_main_job_tp2_cp2():
    """`torchrun --nproc_per_node 4 -m hf_contextpar generate --tp 2`: the needle's answer, the tokens of
    the unpatched model on one process, each rank's KV and weights about half of CP alone's."""
    res = torchrun(4, ["-m", "hf_contextpar", "generate", "--tp", "2", "--prompt-tokens", "1024"], timeout=400)
    why = f"rc {res.returncode}\nstdout:\n{res.stdout[-2000:]}\nstderr:\n{res.stderr[-3000:]}"
    assert res.returncode == 0, why
    assert "expected: '7341' -> correct" in res.stdout and "tokens identical: True" in res.stdout, why
    assert "processes TP 2 x CP 2" in res.stdout, why
    rows = re.findall(
        r"rank (\d) \(cp (\d), tp (\d)\): KV cache (\d+) tokens/layer, ([\d.]+) MiB, weights ([\d.]+)", res.stdout
    )
    assert [(int(r), int(c), int(t)) for r, c, t, *_ in rows] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)], why
    prompt, new = (int(re.search(rf"{w} (\d+) tokens", res.stdout).group(1)) for w in ("prompt", "new"))
    assert sum(int(r[3]) for r in rows[::2]) == prompt + new - 1, why  # each CP group holds every token once
    whole = os.path.getsize(os.path.join(builtin_model_path("needle-lm"), "model.safetensors")) / 2**20
    assert all(float(r[5]) < 0.55 * whole for r in rows), why  # the tied embedding / head is sharded too


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_bench_layouts(tmp_path, kv_heads):
    """TP 1 x CP 4, TP 2 x CP 2 and TP 4 x CP 1 of one model in one run: tokens identical to the unpatched
    model, weights per rank 1/tp (plus the replicated norms), the KV cache split 4 ways in each, no CP
    traffic without CP. With 2 KV heads TP 4 is DCP 2: the same KV per rank, its own DCP traffic, and each
    rank holds its KV head's k/v projections whole (half of theirs instead of a quarter)."""
    out = tmp_path / "layouts.json"
    cmd = ["-m", "hf_contextpar.tools.bench.layouts", "--length", "256", "--new-tokens", "4", "--repeats", "1"]
    res = torchrun(4, [*cmd, "--kv-heads", str(kv_heads), "--out", str(out)], timeout=400)
    assert res.returncode == 0, f"{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    rows = {r["tp"]: r for r in json.load(open(out))["rows"]}
    assert sorted(rows) == [1, 2, 4] and all(r["tokens_identical"] for r in rows.values()), rows
    assert [rows[tp]["dcp"] for tp in (1, 2, 4)] == [1, 1, 4 // kv_heads], rows
    whole = rows[1]["weights_per_rank"]
    assert abs(rows[2]["weights_per_rank"] * 2 - whole) < 0.01 * whole
    if kv_heads == 4:
        assert abs(rows[4]["weights_per_rank"] * 4 - whole) < 0.01 * whole
    else:
        assert 0.25 * whole < rows[4]["weights_per_rank"] < 0.3 * whole, rows
    kv = [r["kv_per_rank"] for r in rows.values()]
    assert max(kv) - min(kv) <= max(kv) / 64, kv  # within a token per layer of a quarter of the cache
    assert rows[4]["sent_per_rank"] == 0 and rows[1]["sent_per_rank"] > rows[2]["sent_per_rank"] > 0
    assert (rows[4]["dcp_sent_per_rank"] > 0) == (kv_heads == 2) and rows[2]["dcp_sent_per_rank"] == 0


def test_main_job_tp4_dcp():
    """`torchrun --nproc_per_node 4 -m hf_contextpar generate --tp 4`: needle-lm has 2 KV heads, so two TP
    ranks share each (DCP 2): the needle's answer, the unpatched model's tokens, each rank's cache half the
    tokens (cp 1 x dcp 2) within one per layer, and about a quarter of the weights."""
    res = torchrun(4, ["-m", "hf_contextpar", "generate", "--tp", "4", "--prompt-tokens", "512"], timeout=400)
    why = f"rc {res.returncode}\nstdout:\n{res.stdout[-2000:]}\nstderr:\n{res.stderr[-3000:]}"
    assert res.returncode == 0, why
    assert "expected: '7341' -> correct" in res.stdout and "tokens identical: True" in res.stdout, why
    assert "processes TP 4 x CP 1 (DCP 2)" in res.stdout, why
    rows = re.findall(
        r"rank (\d) \(cp (\d), tp (\d)\): KV cache (\d+) tokens/layer, ([\d.]+) MiB, weights ([\d.]+)", res.stdout
    )
    assert [(int(r), int(c), int(t)) for r, c, t, *_ in rows] == [(0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 0, 3)], why
    prompt, new = (int(re.search(rf"{w} (\d+) tokens", res.stdout).group(1)) for w in ("prompt", "new"))
    assert all(abs(int(r[3]) - (prompt + new - 1) / 2) <= 1 for r in rows), why
    assert sum(int(r[3]) for r in rows[:2]) == prompt + new - 1, why  # a DCP group holds every token once
    whole = os.path.getsize(os.path.join(builtin_model_path("needle-lm"), "model.safetensors")) / 2**20
    assert all(float(r[5]) < 0.3 * whole for r in rows), why


def test_main_job_refuses_tp_that_splits_a_head():
    """needle-lm has 4 query heads: --tp 3 ends on every rank with one line and exit status 2, at load."""
    for rank, (rc, _, err) in enumerate(launch(4, ["-m", "hf_contextpar", "generate", "--tp", "3"], timeout=300)):
        assert rc == 2 and "error: tensor parallelism over 3 ranks" in err and "Traceback" not in err, (rank, err)
