"""The pass-KV / pass-Q planner: the cost-model rule, Alg. 5 boundaries, h(T,P), calibration I/O.

This file holds the checks that launch ranks (tests/launch.py); the others, and the feature's whole description, are in
tests/unit/test_planner.py.
"""

from __future__ import annotations

import json

from launch import launch


def test_calibrate_and_sweep_commands(tmp_path):
    cal = tmp_path / "cal.json"
    env = {"HF_CONTEXTPAR_CALIBRATION": str(cal)}
    procs = launch(2, ["-m", "hf_contextpar", "calibrate", "--tokens", "256"], timeout=300, env=env)
    assert all(rc == 0 for rc, _, _ in procs), procs[0][2][-3000:]
    data = json.load(open(cal))
    assert data["source"] == "measured" and data["attn_flops"] > 0 and data["bandwidth"] > 0
    out = tmp_path / "sweep.json"
    procs = launch(
        2,
        [
            "-m",
            "hf_contextpar",
            "sweep",
            "--total",
            "512",
            "--miss-rates",
            "0.05,0.25,0.5,1.0",
            "--repeats",
            "1",
            "--out",
            str(out),
        ],
        timeout=300,
        env=env,
    )
    assert all(rc == 0 for rc, _, _ in procs), procs[0][2][-3000:]
    rows = json.load(open(out))["rows"]
    assert len(rows) == 4 and all(r["pass_kv_s"] > 0 and r["pass_q_s"] > 0 for r in rows)
    assert "miss rate" in procs[0][1]
