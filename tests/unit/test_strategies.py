"""All-gather KV, KV-Runahead and Ulysses prefill (issue: the other prefill families), every strategy's
traffic against the analytical formulas, and KV-Runahead's partition search and table.

This file holds the checks that run in the pytest process; the others, and the feature's whole description, are in
tests/multi_process/test_strategies.py.
"""

from __future__ import annotations

import pytest

from hf_contextpar.plan.partitions import PartitionTable, even, search
from hf_contextpar.plan.sharding import partition_sizes


def test_search_finds_the_minimum_of_a_known_cost():
    """Hierarchical grid search on a synthetic TTFT whose best partition is (500, 300, 200)."""
    target = (500, 300, 200)

    def cost(sizes):
        return sum((a - b) ** 2 for a, b in zip(sizes, target)) + 1.0

    sizes, seconds, measured = search(1000, 3, cost, points=5, min_stride=10)
    assert seconds <= measured[tuple(even(1000, 3))]
    assert all(abs(a - b) <= 10 for a, b in zip(sizes, target)), sizes
    assert len(measured) < 200  # hierarchical, not exhaustive


def test_partition_table_interpolates_and_clamps(tmp_path):
    table = PartitionTable(4)
    table.add(8192, [3000, 2100, 1700, 1392])
    table.add(12288, [4200, 3100, 2700, 2288])
    mid = table.ratios(10240)
    for a, lo, hi in zip(mid, table.entries[8192], table.entries[12288]):
        assert a == pytest.approx((lo + hi) / 2)
    for length in (4, 100, 8192, 10000, 12288, 50000):  # inside, on and outside the entries
        sizes = table.sizes(length, 4)
        assert sum(sizes) == length and all(s > 0 for s in sizes)
    assert table.ratios(50000) == table.entries[12288] and table.ratios(100) == table.entries[8192]
    loaded = PartitionTable.load(table.save(str(tmp_path / "t.json")))
    assert loaded.entries == table.entries and loaded.sizes(10000, 4) == table.sizes(10000, 4)
    with pytest.raises(ValueError, match="built for 4 ranks"):
        table.sizes(1000, 2)


def test_partition_sizes_are_exact():
    for n_tok in (1, 2, 3, 7, 101, 4096):
        for ratios in ([1, 1], [0.6, 0.4], [0.35, 0.255, 0.21, 0.185], [1, 0, 0]):
            sizes = partition_sizes(n_tok, ratios)
            assert sum(sizes) == n_tok and len(sizes) == len(ratios)
            if n_tok >= len(ratios):
                assert min(sizes) >= 1
