"""`python -m hf_contextpar selftest` on CPU: the torchrun matrix over gloo (verdict line, JSON report,
exit status), a deliberately broken case that must turn the verdict to FAIL, and --simulated."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import launch
import pytest

from hf_contextpar.api import DECODES, STRATEGIES
from hf_contextpar.tools.cli import main
from hf_contextpar.tools.selftest import spec

ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def selftest(n, *args, timeout=300):
    res = launch.torchrun(n, ["-m", "hf_contextpar", "selftest", "--cpu", *args], timeout=timeout, env=ENV)
    return res, f"rc {res.returncode}\nstdout:\n{res.stdout[-3000:]}\nstderr:\n{res.stderr[-3000:]}"


def test_selftest_under_torchrun_on_cpu(tmp_path):
    """The README's command on 2 CPU processes: every case passes, the report says what ran."""
    report = tmp_path / "report.json"
    res, why = selftest(2, "--json", str(report), "--bench-length", "512", "--bench-repeats", "1")
    assert res.returncode == 0, why
    verdicts = re.findall(
        r"^selftest: (PASS|FAIL) (\d+)/(\d+) cases, N=2, cpu/gloo\+shm, tiny-llama, fp32,bf16,fp16", res.stdout, re.M
    )
    assert verdicts == [("PASS", "36", "36")], why  # one verdict line, on rank 0 only
    r = json.loads(report.read_text())
    assert (
        r["passed"]
        and r["failed"] == []
        and r["world"] == 2
        and r["backend"] == "gloo"
        and r["transport"] == "gloo+shm"
    ), why
    names = {c["name"] for c in r["cases"]}
    for dtype in ("float32", "bfloat16", "float16"):
        assert {f"{dtype}/greedy/{s}" for s in STRATEGIES} <= names
        assert {f"{dtype}/padded/{d}" for d in DECODES} <= names
        assert f"{dtype}/second_turn/auto" in names
    for c in r["cases"]:
        assert c["status"] == "pass" and c["max_diff"] <= c["tolerance"], (c, why)
        if c["dtype"] == "float32":  # the strict column: fp32 logits within 1e-4, tokens identical throughout
            assert c["tolerance"] == 1e-4 and "near-tie" not in c["detail"], (c, why)
    bench = r["benchmark"]
    assert bench["length"] == 512 and bench["cp"]["ttft_s"] > 0 and bench["one_process"]["ttit_s"] > 0, (bench, why)
    assert sum(bench["algorithms"].values()) > 0, (bench, why)  # the patched model ran


def test_a_broken_case_turns_the_verdict_to_fail(tmp_path):
    """--inject-fault perturbs one case's results inside the checker: FAIL, exit != 0, the case listed."""
    report = tmp_path / "report.json"
    case = "float32/greedy/ring_pass_q"
    res, why = selftest(2, "--dtypes", "fp32", "--no-bench", "--inject-fault", case, "--json", str(report))
    assert res.returncode != 0, why
    assert re.search(r"^selftest: FAIL 11/12 cases, N=2, cpu/gloo\+shm", res.stdout, re.M), why
    assert re.search(rf"FAILED {case}: rank 0: prompt logits differ by 1 > 0.0001; tokens differ", res.stdout), why
    r = json.loads(report.read_text())
    assert not r["passed"] and r["failed"] == [case]
    assert all(c["status"] == "pass" for c in r["cases"] if c["name"] != case)  # the others are unaffected


def test_selftest_on_one_process_says_how_to_launch():
    res = subprocess.run(
        [sys.executable, "-m", "hf_contextpar", "selftest", "--cpu"], env=ENV, capture_output=True, text=True
    )
    assert res.returncode == 2 and "torchrun --nproc_per_node N" in res.stderr and "--simulated" in res.stderr


def test_simulated_on_cpu(tmp_path):
    """Every algorithm on N = 2, 3, 4 simulated ranks, the kernels and the merge, in fp32/bf16/fp16."""
    report = tmp_path / "sim.json"
    res = subprocess.run(
        [sys.executable, "-m", "hf_contextpar", "selftest", "--simulated", "--cpu", "--json", str(report)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    why = f"rc {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    assert res.returncode == 0, why
    assert re.search(r"^selftest --simulated: PASS (\d+)/\1 checks, cpu, fp32,bf16,fp16, N=2,3,4", res.stdout, re.M), (
        why
    )
    names = {c["name"] for c in json.loads(report.read_text())["checks"]}
    for case in spec.CASES:
        for n in (2, 3, 4):
            assert any(name.startswith(f"algorithm/{case.name}/N{n}/") and name.endswith("/fp16") for name in names)
    assert {"backend/cpu_flash_causal/bf16", "kernels+merge/all/per_sequence/fp16"} <= names


def test_simulated_checker_fails_on_a_broken_merge(monkeypatch, capsys):
    """A merge that drops the second partial's weight must fail the kernel+merge and algorithm checks."""
    from hf_contextpar.attention import merge

    real = merge.merge_pair
    monkeypatch.setattr(merge, "merge_pair", lambda oa, la, ob, lb: (real(oa, la, ob, lb)[0], la))  # LSE not merged
    with pytest.raises(SystemExit) as e:
        main(["selftest", "--simulated", "--cpu", "--dtypes", "fp32"])
    out = capsys.readouterr().out
    assert e.value.code == 1, out
    assert re.search(r"^selftest --simulated: FAIL \d+/\d+ checks", out, re.M), out
    assert "FAILED kernels+merge/causal/contiguous/fp32: AssertionError: running merge (ring): out differs" in out
    assert "FAILED algorithm/ring_pass_kv/N2/" in out
    assert "FAILED backend/" not in out  # the fused kernels alone merge nothing: still right
