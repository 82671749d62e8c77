"""KV interleave (issue 13, vLLM's cp_kv_cache_interleave_size): decode K/V in runs of k tokens per
rank is exact for every k, decode mode and batch, over several turns and with draft-cropping
decoding, on N = 2 and 3 ranks against the unpatched model (tests/workers/interleave_worker.py)."""

import pytest
from interleave_worker import cases
from launch import matrix

PARAMS = [(n, name) for n in (2, 3) for name, _ in cases(n)]


@pytest.mark.parametrize("n,case", PARAMS, ids=[f"N{n}-{c}" for n, c in PARAMS])
def test_case(n, case, tmp_path_factory):
    records = matrix("interleave_worker.py", n, tmp_path_factory)
    for rank, recs in enumerate(records):
        rec = next(r for r in recs if r["case"] == case)
        assert rec["ok"], f"rank {rank}: {rec}"
