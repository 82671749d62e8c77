"""The README's main job: `torchrun --nproc_per_node 2 -m hf_contextpar generate --baseline`."""

from __future__ import annotations

import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from launch import free_port  # noqa: E402


def test_cli_generate_under_torchrun():
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", f"--master_port={free_port()}",
           "-m", "hf_contextpar", "generate", "--prompt-tokens", "300", "--max-new-tokens", "8", "--baseline"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    why = f"rc {res.returncode}\nstdout:\n{res.stdout[-2000:]}\nstderr:\n{res.stderr[-3000:]}"
    assert res.returncode == 0, why
    assert "processes 2  prompt 300 tokens" in res.stdout and "TTFT" in res.stdout, why
    cached = [int(m) for m in re.findall(r"rank \d: KV cache (\d+) tokens/layer", res.stdout)]
    assert len(cached) == 2 and max(cached) <= 307 // 2 + 1 and sum(cached) == 307, why  # 300 prompt + 7 decoded
    assert "tokens identical: True" in res.stdout, why
