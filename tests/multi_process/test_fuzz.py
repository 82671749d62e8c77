"""Seeded differential fuzz test (issue 10): random cases on N = 2, 3, 4 CPU processes against
the unpatched single-process model. One launch per N runs cases until its time budget is spent
(see tests/workers/fuzz_worker.py for what a case draws and how it is compared).

    python -m pytest tests/multi_process/test_fuzz.py                              # CI: fixed seed, 20 s of cases per N
    HF_CONTEXTPAR_FUZZ_SEED=random HF_CONTEXTPAR_FUZZ_SECONDS=1800 python -m pytest tests/multi_process/test_fuzz.py -s
    HF_CONTEXTPAR_FUZZ_SEED=7 HF_CONTEXTPAR_FUZZ_CASE=17 python -m pytest tests/multi_process/test_fuzz.py -k N3 -s

HF_CONTEXTPAR_FUZZ_SECONDS: budget per N (no case starts after it); HF_CONTEXTPAR_FUZZ_SEED: an
integer or "random" (printed, and in the failure message); HF_CONTEXTPAR_FUZZ_CASE: run exactly
these case indices (comma-separated). Every failing case comes with the torchrun command that
reruns it alone.
"""

from __future__ import annotations

import json
import os

import pytest
from launch import launch, worker_path

DEFAULT_SECONDS = 16.0
MIN_CASES = 4  # passing cases: the default budget runs 6 to 45 here (2 shared cores); fewer means the loop broke


@pytest.mark.parametrize("n", [2, 3, 4], ids=lambda n: f"N{n}")
def test_fuzz(n, tmp_path):
    seconds = float(os.environ.get("HF_CONTEXTPAR_FUZZ_SECONDS", DEFAULT_SECONDS))
    only = os.environ.get("HF_CONTEXTPAR_FUZZ_CASE")
    args = [
        worker_path("fuzz_worker.py"),
        "--out",
        str(tmp_path),
        "--seconds",
        str(seconds),
    ]
    if only:
        args += ["--case", only]
    procs = launch(n, args, timeout=seconds + 900)
    print(procs[0][1])  # rank 0's log: one line per case (shown with -s, or on failure)
    path = tmp_path / "fuzz.json"
    assert path.exists(), f"no results; rank 0 exited {procs[0][0]}:\n{procs[0][2][-4000:]}"
    report = json.loads(path.read_text())
    records = report["records"]
    failures = [r for r in records if r["outcome"] == "fail"]
    lines = [
        f"case {r['index']}: {r['detail'].splitlines()[0][:400]}\n    {r['description']}\n    reproduce: {r['command']}"
        for r in failures
    ]
    assert not failures, (
        f"{len(failures)} of {len(records)} fuzz cases failed on N={n} (seed {report['seed']}):\n" + "\n".join(lines)
    )
    assert report["finished"], f"the fuzz loop did not finish (seed {report['seed']}):\n{procs[0][2][-4000:]}"
    passed = [r for r in records if r["outcome"] in ("pass", "expected_error")]
    wanted = len(only.split(",")) if only else MIN_CASES
    assert len(passed) >= wanted, f"only {len(passed)} of {len(records)} cases passed on N={n} (seed {report['seed']})"
    for rank, (rc, _, err) in enumerate(procs):
        assert rc == 0, f"rank {rank} exited {rc} after a clean fuzz run:\n{err[-3000:]}"
