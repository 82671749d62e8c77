"""Attention geometries of real checkpoints (issue 11): many and wide heads, GQA 4:1 to 8:1, QKV
bias, soft-capping, per-layer-type RoPE, llama3 / YaRN / longrope scaling, sliding windows,
shrunk to a few MB (tests/workers/geometries.py), on N = 2 and 3 (DeepSeek-V4-Flash's at 4 too) against the unpatched
single process."""

from __future__ import annotations

import pytest
from geometries import GEOMETRIES, geometry_model_type
from launch import matrix, selected
from records import tolerance

AT_FOUR = ["deepseek_v4_flash"]  # the sparse frontier's tiny flagship (issue 43) at N = 4 as well


@pytest.mark.parametrize("n,name", [(n, name) for n in (2, 3) for name in GEOMETRIES] + [(4, name) for name in AT_FOUR])
def test_geometry_exact(n, name, request, tmp_path_factory):
    args = selected(request, "name", list(GEOMETRIES))  # N = 4: only AT_FOUR's
    for rank, records in enumerate(matrix("geometry_worker.py", n, tmp_path_factory, args)):
        mine = [r for r in records if r["geometry"] == name]
        errors = [r["error"] for r in mine if r["case"] == "error"]
        assert not errors, f"rank {rank}: {errors[0]}"
        assert {r["case"] for r in mine} == {"prefill_logits", "greedy"}
        for r in mine:
            where = f"rank {rank} {r}"
            if r["case"] == "prefill_logits":
                bound = 1e-10 if r["fp64_internals"] else tolerance(geometry_model_type(name), r["dtype"])
                assert r["max_diff"] <= bound, where
            else:
                assert r["tokens_equal"] and r["ranks_agree"], where
