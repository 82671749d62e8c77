"""Lint and format: ruff with the project's configuration (pyproject.toml) over the whole tree."""

import subprocess
import sys

from areas import ROOT  # the repository root


def _ruff(*args):
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_ruff_check():
    res = _ruff("check", ".")
    assert res.returncode == 0, res.stdout + res.stderr


def test_ruff_format():
    res = _ruff("format", "--check", ".")
    assert res.returncode == 0, res.stdout + res.stderr
