"""`predict --gpus`: the (tp, cp) layout recommended for a model on G GPUs (hf_contextpar/tools/layout.py), on paper.

This file holds the checks that run in the pytest process; the ones that launch ranks are in tests/multi_process/test_tp_layouts.py.
"""

from __future__ import annotations

from hf_contextpar.plan.costmodel import kv_bytes_per_rank
from hf_contextpar.tools.layout import layouts, recommend
from hf_contextpar.tools.presets import PRESETS, shape_of

M = PRESETS["h100-rdma"]


def by_tp(rows):
    return {r["tp"]: r for r in rows}


def test_a_70b_model_on_8_16_64_gpus():
    one_m = by_tp(layouts("llama-3.1-70b", 8, 1 << 20, M, "bfloat16", 8, 80e9))
    assert sorted(one_m) == [1, 2, 4, 8]
    # weights: 1/tp of 70.6 G parameters (linear maps, embedding and head) in bf16
    assert 140e9 < one_m[1]["weights"] < 142e9 and abs(one_m[8]["weights"] * 8 - one_m[1]["weights"]) < 8 * 2
    # KV: 80 layers x 2 x 1M tokens x 8 heads x 128 x 2 bytes, split over all 8 GPUs whatever the layout
    assert all(r["kv"] == 80 * 2 * (1 << 20) * 8 * 128 * 2 / 8 for r in one_m.values())
    assert [t for t, r in one_m.items() if r["fits"]] == [8]
    assert recommend(list(one_m.values()))["tp"] == 8
    # 16 GPUs at 128K: TP 4 and TP 8 fit; TP 8 decodes faster for a prefill at most 10% slower
    rows = layouts("llama-3.1-70b", 16, 131072, M, "bfloat16", 8, 80e9)
    best = recommend(rows)
    assert (best["tp"], best["cp"]) == (8, 2)
    assert best["ttft"] <= 1.1 * min(r["ttft"] for r in rows if r["fits"])
    assert best["ttit"] == min(r["ttit"] for r in rows if r["fits"])
    # nothing fits: no recommendation
    assert recommend(layouts("llama-3.1-405b", 8, 1 << 20, M, "bfloat16", 8, 80e9)) is None


def test_tp_stays_in_a_node_and_divides_the_kv_heads():
    rows = layouts("tiny-llama", 8, 4096, M, "float32", 8, 80e9)  # 4 query / 2 KV heads
    assert sorted(r["tp"] for r in rows) == [1, 2]  # TP 4 would split a KV head (needs DCP)
    assert sorted(r["tp"] for r in layouts("llama-3.1-8b", 16, 4096, M, "bfloat16", 4, 80e9)) == [1, 2, 4]
    s = shape_of("llama-3.1-8b", 2, 2)
    assert (s.heads, s.kv_heads) == (16, 4) and kv_bytes_per_rank(4096, 4, s) * 8 == kv_bytes_per_rank(
        4096, 1, shape_of("llama-3.1-8b", 2)
    )
