"""Attention geometries of real checkpoints (issue 11): many and wide heads, GQA 4:1 to 8:1, QKV
bias, soft-capping, per-layer-type RoPE, llama3 / YaRN / longrope scaling, sliding windows,
shrunk to a few MB (tests/geometries.py), on N = 2 and 3 against the unpatched single process."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from geometries import GEOMETRIES, geometry_model_type  # noqa: E402
from launch import matrix, tolerance  # noqa: E402


@pytest.mark.parametrize("name", list(GEOMETRIES))
@pytest.mark.parametrize("n", [2, 3])
def test_geometry_exact(n, name, tmp_path_factory):
    for rank, records in enumerate(matrix("geometry_worker.py", n, tmp_path_factory)):
        mine = [r for r in records if r["geometry"] == name]
        errors = [r["error"] for r in mine if r["case"] == "error"]
        assert not errors, f"rank {rank}: {errors[0]}"
        assert {r["case"] for r in mine} == {"prefill_logits", "greedy"}
        for r in mine:
            where = f"rank {rank} {r}"
            if r["case"] == "prefill_logits":
                assert r["max_diff"] <= tolerance(geometry_model_type(name), r["dtype"]), where
            else:
                assert r["tokens_equal"] and r["ranks_agree"], where
