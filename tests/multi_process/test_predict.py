"""`python -m hf_contextpar predict`: the cost model on paper, for any model and machine.

This file holds the checks that launch ranks (tests/launch.py); the others, and the feature's whole description, are in
tests/unit/test_predict.py.
"""

import json
import subprocess
import sys

from hf_contextpar.plan.machine import Machine


def test_cli_with_a_calibration_file(tmp_path):
    cal = tmp_path / "cal.json"
    Machine(
        attn_flops=2e10, gemm_flops=3e10, bandwidth=1e9, latency=1e-4, memory_bandwidth=1e10, source="measured"
    ).save(str(cal))
    assert json.load(open(cal))["memory_bandwidth"] == 1e10
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "hf_contextpar",
            "predict",
            "--model",
            "tiny-llama",
            "--hardware",
            str(cal),
            "--world",
            "1,2",
            "--lengths",
            "4096",
            "--dtype",
            "float32",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "ring_pass_q" in res.stdout and "measured" in res.stdout
