"""The exactness harness (`python -m hf_contextpar.eval`): prompt construction, and end to end on
the built-in model, offline, N=2 (CPU, gloo): it says "equivalent" for the real engine and
"not equivalent" (exit 1) for an engine with one ring step dropped.

This file holds the checks that launch ranks (tests/launch.py); the others, and the feature's whole description, are in
tests/unit/test_eval.py.
"""

from __future__ import annotations

import json
import os

import pytest
from hf_contextpar.eval import needlebench as nb
from launch import launch, worker_path

WORKER = worker_path("eval_worker.py")


def _report(out):
    with open(os.path.join(out, "report.json")) as f:
        rep = json.load(f)
    for name in (
        ("report.md", "heatmap.png", "logit_diff.png")
        if rep["summary"]["kind"] == "needlebench"
        else ("report.md", "logit_diff.png")
    ):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    return rep


def _check(procs, expect_rc):
    for rank, (rc, out, err) in enumerate(procs):
        assert rc == expect_rc, f"rank {rank} exited {rc} (expected {expect_rc}):\n{out[-2000:]}\n{err[-4000:]}"


def test_needlebench_equivalent_n2(tmp_path):
    out = tmp_path / "nb"
    procs = launch(
        2,
        [
            "-m",
            "hf_contextpar.eval",
            "needlebench",
            "--model",
            "tiny-llama",
            "--lengths",
            "1024",
            "--depths",
            "0,50,100",
            "--max-new-tokens",
            "6",
            "--needles",
            "0,3",
            "--out",
            str(out),
        ],
        timeout=300,
    )
    _check(procs, 0)
    assert "needlebench: EQUIVALENT" in procs[0][1] and procs[1][1] == ""  # rank 0 reports, the others stay quiet
    rep = _report(out)
    s = rep["summary"]
    # single_retrieval: one prompt per listed needle in every cell; the other tasks one each
    assert s["verdict"] == "equivalent" and s["world"] == 2 and s["cases"] == 12 and s["tolerance"] == 1e-4
    assert sorted((c["task"], c["depth"], c["needle"]) for c in rep["cases"]) == sorted(
        [("single_retrieval", d, i) for d in (0, 50, 100) for i in (0, 3)]
        + [(t, d, None) for t in nb.TASKS[1:] for d in (0, 50, 100)]
    )
    assert len({c["key"] for c in rep["cases"]}) == 12
    for c in rep["cases"]:
        assert c["tokens_identical"] and c["first_divergence"] is None and c["max_logit_diff"] <= 1e-4
        assert c["ref_answer"] == c["cp_answer"] and c["new_tokens"] == [6, 6] and c["prompt_tokens"] <= 1024
    md = open(out / "report.md").read()
    assert "**Verdict: equivalent**" in md and md.count("| single_retrieval |") == 6


def test_needlebench_replicas_write_the_single_groups_report(tmp_path):
    """4 processes as 2 replicas of CP 2 (`--cp-size 2`): each replica runs half the cases, and the one report
    rank 0 writes is the report of one CP group of 2 running them all (the same answers, the same logits)."""
    args = ["-m", "hf_contextpar.eval", "needlebench", "--model", "tiny-llama", "--lengths", "1024"]
    args += ["--depths", "0,50,100", "--max-new-tokens", "6", "--needles", "0,3"]
    one, two = tmp_path / "one", tmp_path / "two"
    _check(launch(2, [*args, "--out", str(one)], timeout=300), 0)
    procs = launch(4, [*args, "--cp-size", "2", "--out", str(two)], timeout=300)
    _check(procs, 0)
    assert all(out == "" for _, out, _ in procs[1:])  # rank 0 reports
    single, replicas = _report(one), _report(two)
    assert replicas["summary"]["world"] == 2 and replicas["summary"]["cases"] == 12
    assert replicas["summary"]["verdict"] == single["summary"]["verdict"] == "equivalent"
    same = ("key", "task", "depth", "ref_answer", "cp_answer", "tokens_identical", "max_logit_diff", "new_tokens")
    assert [{k: c[k] for k in same} for c in replicas["cases"]] == [{k: c[k] for k in same} for c in single["cases"]]


def test_needlebench_needle_lm_n3_real_scores(tmp_path):
    """The shipped model through the harness on 3 processes: equivalent to one process (tokens identical,
    logits within fp32 tolerance), and the scores are real retrieval, not 0 both ways."""
    out = tmp_path / "nb"
    args = ["-m", "hf_contextpar.eval", "needlebench", "--lengths", "1024", "--depths", "0,50,100"]
    args += ["--tasks", "single_retrieval", "--needles", "all", "--threads", "1", "--out", str(out)]
    procs = launch(3, args, timeout=600)
    _check(procs, 0)
    s = _report(out)["summary"]
    assert s["verdict"] == "equivalent" and s["world"] == 3 and s["cases"] == 24
    score = s["scores"]["single_retrieval"]
    assert score["reference"] == score["context_parallel"] >= 95, score  # shipped weights: 100 (24 of 24)


def test_needlebench_broken_ring_is_not_equivalent(tmp_path):
    out = tmp_path / "broken"
    procs = launch(
        2,
        [
            WORKER,
            "needlebench",
            "--model",
            "tiny-llama",
            "--lengths",
            "1024",
            "--depths",
            "0,100",
            "--tasks",
            "single_retrieval",
            "--max-new-tokens",
            "4",
            "--strategy",
            "ring_pass_kv",
            "--out",
            str(out),
        ],
        timeout=300,
        env={"HF_CONTEXTPAR_TEST_BREAK_RING": "1"},
    )
    _check(procs, 1)
    assert "needlebench: NOT EQUIVALENT" in procs[0][1]
    s = _report(out)["summary"]
    assert s["verdict"] == "not equivalent" and s["equivalent_cases"] == 0 and s["worst_logit_diff"] > 1e-2


def test_bookcorpus_saved_reference_n2(tmp_path):
    from hf_contextpar.eval.cli import main

    ref = tmp_path / "ref.pt"
    args = ["bookcorpus", "--model", "tiny-llama", "--window", "700", "--num-windows", "3"]
    assert main(args + ["--save-reference", str(ref)]) == 0  # one process: this one
    out = tmp_path / "bc"
    procs = launch(2, ["-m", "hf_contextpar.eval", *args, "--reference", str(ref), "--out", str(out)], timeout=300)
    _check(procs, 0)
    rep = _report(out)
    assert rep["summary"]["verdict"] == "equivalent" and rep["summary"]["reference"].startswith(
        "saved single-process run"
    )
    assert [c["window"] for c in rep["cases"]] == [0, 1, 2]
    for c in rep["cases"]:
        assert c["tokens"] == 700 and c["argmax_agreement"] == 1.0 and c["max_logit_diff"] <= 1e-4
        assert c["max_nll_diff"] <= 1e-4 and c["ppl_ref"] == pytest.approx(c["ppl_cp"], rel=1e-5) and c["ppl_ref"] > 1


def test_csa_report_beside_the_exact_run_n2(tmp_path):
    """`eval csa`: NeedleBench cells and a BookCorpus window under the exact run, CSA and one process; the exact
    run is the one process's, CSA its reference's, and the dropping saves bytes against keep-all CSA. With
    --exact-strategies all, every exact prefill strategy's prefill per rank beside CSA's, the fastest named."""
    from hf_contextpar.eval.csa_strategies import CSA_EVEN

    from hf_contextpar.plan.strategies import prefill_names

    out = tmp_path / "csa"
    args = ["-m", "hf_contextpar.eval", "csa", "--csa", "0.5", "--lengths", "768", "--depths", "50"]
    args += ["--exact-strategies", "all"]
    procs = launch(2, [*args, "--num-windows", "1", "--window", "512", "--max-new-tokens", "8", "--out", str(out)])
    _check(procs, 0)
    rep = json.load(open(out / "report.json"))
    s = rep["summary"]
    assert s["exact_equivalent"] and s["csa_matches_reference"] and s["world"] == 2
    assert s["csa"] == "CSA(topology=1x2, keep L2=0.5, observe=64)"
    assert s["bytes_csa"] < s["bytes_keep_all"] and s["ppl_csa"] is not None
    assert [r["key"] for r in rep["records"]] == ["single_retrieval/768/50", "multi_retrieval/768/50", "window/0"]
    assert "| window/0 |" in (out / "report.md").read_text()
    st = s["strategies"]
    ran = set(st["prefill_s_per_rank"])
    assert ran | set(st["skipped_strategies"]) == {*prefill_names(), "exact run (auto)", "csa", CSA_EVEN}
    assert all(len(t) == 2 and all(x > 0 for x in t) for t in st["prefill_s_per_rank"].values())
    assert st["fastest_exact"] in ran - {"csa", CSA_EVEN} and st["csa_over_fastest_exact"] > 0
    # CSA's balanced partitions (the default), which its reference cut too: front-loaded
    cuts = [r["csa_partitions"] for r in rep["records"]]
    assert all(len(c) == 2 and c[0] >= c[1] > 0 for c in cuts) and sum(cuts[2]) < sum(cuts[0]), cuts
    assert set(st["prefill_s_slowest_by_length"]) == {"768", "window (512)"}
    assert "## Prefill per rank: CSA beside every exact strategy" in (out / "report.md").read_text()


def test_csa_config_writes_settings_the_mode_loads(tmp_path):
    """`eval csa-config` on the calibration split: a curve from keep-all down, the chosen settings in a file
    that `CSA.load` (and `--csa FILE`) reads back."""
    from hf_contextpar.sparse import CSA

    out = tmp_path / "cfg"
    args = ["-m", "hf_contextpar.eval", "csa-config", "--lengths", "512", "--depths", "50", "--grid", "1.0,0.5"]
    extra = ["--tasks", "single_retrieval", "--max-new-tokens", "8", "--window", "512", "--out", str(out)]
    procs = launch(2, [*args, *extra])
    _check(procs, 0)
    saved = json.load(open(out / "csa_settings.json"))
    assert all(p["ppl_increase_pct"] is not None for p in saved["curve"]) and saved["max_ppl_increase"] == 1.0
    assert all(p["ppl_increase_pct"] <= 1.0 for p in saved["curve"] if p["keep"] >= saved["keep"])
    assert [p["keep"] for p in saved["curve"]][:1] == [1.0] and saved["keep"] in (1.0, 0.5)
    assert all(p["drop"] <= 0 for p in saved["curve"] if p["keep"] >= saved["keep"])
    assert CSA.load(str(out / "csa_settings.json")).keep == saved["keep"]
    assert "keep (level 2) | score | drop | ppl +%" in procs[0][1]
