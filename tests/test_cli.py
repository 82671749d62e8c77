"""The README's main job: `torchrun --nproc_per_node 2 -m hf_contextpar generate` (needle-lm, a needle prompt)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from launch import free_port  # noqa: E402


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
