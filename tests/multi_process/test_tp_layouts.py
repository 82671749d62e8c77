"""`predict --gpus`: the (tp, cp) layout recommended for a model on G GPUs (hf_contextpar/tools/layout.py), on paper.

This file holds the checks that launch ranks (tests/launch.py); the others, and the feature's whole description, are in
tests/unit/test_tp_layouts.py.
"""

from __future__ import annotations

import subprocess
import sys


def test_cli():
    cmd = [sys.executable, "-m", "hf_contextpar", "predict", "--model", "llama-3.1-70b", "--gpus", "8,16"]
    res = subprocess.run([*cmd, "--lengths", "131072"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("recommended: TP 8 x CP") == 2 and "| 1 | 8 | 131.41 GiB |" in res.stdout
