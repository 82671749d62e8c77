"""CUDA only (skipped where there is no GPU, as in CI): the selftest on the GPU kernels.

- one GPU: `selftest --simulated` in bf16/fp16/fp32 (every algorithm on simulated ranks, the flash and
  memory-efficient SDPA backends, masks and merge), plus a short `--timing` run;
- two GPUs or more: the torchrun selftest over NCCL, one rank per GPU (one GPU hosts one NCCL rank).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from launch import free_port

GPUS = torch.cuda.device_count()
ENV = dict(os.environ, OMP_NUM_THREADS="4", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
one_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU (torch.cuda.device_count() == 0)")
two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs for 2 NCCL ranks ({GPUS} present)")


def _run(args, timeout=900):
    res = subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=timeout)
    return res, f"rc {res.returncode}\nstdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-3000:]}"


@one_gpu
def test_simulated_selftest_on_cuda(tmp_path):
    report = tmp_path / "sim.json"
    res, why = _run([sys.executable, "-m", "hf_contextpar", "selftest", "--simulated", "--json", str(report)])
    assert res.returncode == 0, why
    assert re.search(r"^selftest --simulated: PASS (\d+)/\1 checks, cuda, fp32,bf16,fp16, N=2,3,4", res.stdout, re.M), (
        why
    )
    names = {c["name"] for c in json.loads(report.read_text())["checks"]}
    for dname in ("bf16", "fp16"):  # the flash kernel (fp16/bf16 only) and the memory-efficient one
        assert {f"backend/flash_causal/{dname}", f"backend/efficient_bias/{dname}"} <= names
    assert {f"backend/kernels_use_fused/{d}" for d in ("fp32", "bf16", "fp16")} <= names


@one_gpu
def test_kernel_timing_on_cuda(tmp_path):
    report = tmp_path / "timing.json"
    res, why = _run(
        [
            sys.executable,
            "-m",
            "hf_contextpar",
            "selftest",
            "--simulated",
            "--dtypes",
            "bf16",
            "--timing",
            "--timing-lengths",
            "8192,32768",
            "--json",
            str(report),
        ]
    )
    assert res.returncode == 0, why
    rows = json.loads(report.read_text())["timing"]
    assert [r["length"] for r in rows] == [8192, 32768]
    assert all(r["sdpa_s"] > 0 and r["rank_s"] > 0 and r["merge_s"] > 0 for r in rows)


@two_gpus
def test_torchrun_selftest_over_nccl(tmp_path):
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", f"--master_port={free_port()}"]
    res, why = _run([*cmd, "-m", "hf_contextpar", "selftest", "--json", str(report)])
    assert res.returncode == 0, why
    assert re.search(r"^selftest: PASS (\d+)/\1 cases, N=2, cuda/nccl", res.stdout, re.M), why
    r = json.loads(report.read_text())
    assert r["passed"] and r["backend"] == "nccl" and r["benchmark"]["cp"]["ttft_s"] > 0
