"""The README's main job: `torchrun --nproc_per_node 2 -m hf_contextpar generate` (needle-lm, a needle prompt).

This file holds the checks that launch ranks (tests/launch.py); the in-process ones are in tests/unit/test_cli.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from areas import ROOT  # the repository root
from launch import free_port, python


def test_cli_generate_under_torchrun():
    """The README's main job on 2 processes: the needle's answer, identical to the unpatched single process."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        f"--master_port={free_port()}",
        "-m",
        "hf_contextpar",
        "generate",
    ]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    why = f"rc {res.returncode}\nstdout:\n{res.stdout[-2000:]}\nstderr:\n{res.stderr[-3000:]}"
    assert res.returncode == 0, why
    assert "question: What number does the lighthouse keeper of Velmora Point paint" in res.stdout, why
    assert "answer:   The number is 7341." in res.stdout and "expected: '7341' -> correct" in res.stdout, why
    assert re.search(r"processes 2  prompt 40[6-9]\d tokens", res.stdout), why  # the longest prompt of <= 4096 tokens
    new = int(re.search(r"new (\d+) tokens", res.stdout).group(1))
    prompt = int(re.search(r"prompt (\d+) tokens", res.stdout).group(1))
    cached = [int(m) for m in re.findall(r"rank \d: KV cache (\d+) tokens/layer", res.stdout)]
    assert len(cached) == 2 and sum(cached) == prompt + new - 1 and max(cached) - min(cached) <= 1, why
    assert "tokens identical: True" in res.stdout, why


def test_eval_gate_does_not_pass_on_an_earlier_report(tmp_path):
    """A harness run that fails before writing its report leaves no earlier report to pass on."""
    for kind in ("needlebench", "bookcorpus"):  # an earlier run's verdicts
        os.makedirs(tmp_path / kind)
        (tmp_path / kind / "report.json").write_text('{"summary": {"verdict": "equivalent"}}')
    gate = os.path.join(ROOT, "examples", "eval_gate.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    res = python([gate, "--lengths", "512,x", "--dtype", "int8", "--out", str(tmp_path)], env=env, timeout=300)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert "needlebench: could not run" in res.stdout and "bookcorpus: could not run" in res.stdout, res.stdout


def test_eval_drops_an_earlier_report_before_anything_can_fail(tmp_path):
    (tmp_path / "report.json").write_text('{"summary": {"verdict": "equivalent"}}')
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    cmd = ["-m", "hf_contextpar.eval", "needlebench", "--lengths", "512,x", "--out", str(tmp_path)]
    res = python(cmd, env=env, timeout=300)
    assert res.returncode == 2 and "--lengths takes comma-separated integers" in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "report.json").exists()
