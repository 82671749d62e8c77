"""Every verified family, exact under context parallelism, in every run (issue 57).

`patches/verified.py` lists the families the model census found exact at N = 2, 3 and 4 under every strategy; they
run with no opt-in. The census's own re-run in CI (tests/*/test_census.py) draws a few a day, so a regression in one
family (qwen4_exp_text's crash in the sharded cache's indexer exchange, a43a549) could stay unseen for weeks. Here each of them
gets one short exact check in every run: one launch of 2 ranks (tests/workers/family_worker.py), fp64 as the census ran
them, the census's forward, greedy generate and second turn over the returned cache, against the unpatched model
on one process within the committed tolerance (tokens identical, or a near-tie by the oracle's rule). Each family
is its own test (`test_verified_family_is_exact[qwen4_exp_text]`) and only the selected ones are launched
(`-k`); a failure names every family that failed in the launch, why, and how to re-run just those.

`test_the_check_fails_a_broken_family` is the check's own test: real faults in two families' attention, inside the
launched ranks (wrong logits on one rank; an error), must fail those families and no other.

This file holds the checks that launch ranks (tests/launch.py); the in-process ones are in tests/unit/test_families.py.
"""

from __future__ import annotations

import json
import os

import pytest
from family_worker import BREAK, families
from launch import launch, matrix, worker_path

WORKER = worker_path("family_worker.py")
CHOSEN = os.environ.get("HF_CONTEXTPAR_FAMILIES")  # a re-run of some families (the failure message says which)
ALL = [f["family"] for f in families()]
FAMILIES = CHOSEN.split(",") if CHOSEN else ALL  # a name that is not a verified family fails its test


def why(rec: dict) -> str:
    """One line: what the family's check found (a crash: each rank's error where they differ)."""
    err = rec.get("error") or {}
    if rec.get("disagreement"):
        return f"the ranks disagree: {rec['disagreement']}"
    if err:
        where = f" ({err['where']})" if err.get("where") else ""
        ranks = rec.get("rank_errors") or []
        by_rank = f"; by rank: {ranks}" if len(set(ranks)) > 1 else ""
        return f"{rec['outcome']} at {err.get('stage')}: {err.get('last_line')}{where}{by_rank}"
    tokens = "tokens identical" if rec["tokens_equal"] else f"tokens diverge at {rec['diverged']}"
    return f"max |logit diff| {rec['max_diff']:.2e} (tolerance {rec['tolerance']:.0e}), {tokens}"


def failures(records: list[dict]) -> dict[str, str]:
    """{family: why} for every family whose check is not exact."""
    return {r["family"]: why(r) for r in records if r["outcome"] != "exact"}


def report(failed: dict[str, str]) -> str:
    names = ",".join(failed)
    lines = [f"  {f}: {w}" for f, w in failed.items()]
    return "\n".join(
        [
            f"{len(failed)} verified famil{'y' if len(failed) == 1 else 'ies'} not exact under context parallelism:",
            *lines,
            f"re-run just these: HF_CONTEXTPAR_FAMILIES={names} python -m pytest -q tests/*/test_families.py",
            f"(or the worker alone: HF_CONTEXTPAR_FAMILIES={names} torchrun --nproc_per_node 2 tests/workers/family_worker.py "
            "OUT_DIR; a traceback each in OUT_DIR/rank0.json)",
        ]
    )


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory) -> dict[str, dict]:
    """Every selected family's agreed record, from one launch of the worker on 2 ranks."""
    test = "test_verified_family_is_exact"
    wanted = {i.callspec.params["family"] for i in request.session.items if getattr(i, "originalname", "") == test}
    subset = [f for f in ALL if f in wanted]
    args = () if subset == ALL else (",".join(subset),)
    return {r["family"]: r for r in matrix("family_worker.py", 2, tmp_path_factory, args)[0]}


@pytest.mark.parametrize("family", FAMILIES)
def test_verified_family_is_exact(family, outcomes):
    assert family in outcomes, (
        f"{family}: not a verified family (patches/verified.py), or the worker ran no check of it"
    )
    failed = failures(list(outcomes.values()))
    assert family not in failed, report(failed)


def test_the_check_fails_a_broken_family(tmp_path):
    """The worker with HF_CONTEXTPAR_FAMILY_BREAK=llama,qwen2:raise: llama's attention output moved by a relative 1e-6
    on the last rank (in the first group of references, beside gemma2), qwen2's attention raising on every rank (in
    the second, beside mistral). Both must fail, llama by its logits, qwen2 as a crash; gemma2 (before the faults)
    and mistral (after llama's was unwrapped) pass."""
    env = {BREAK: "llama,qwen2:raise"}
    procs = launch(2, [WORKER, str(tmp_path), "gemma2,llama,mistral,qwen2"], env=env, timeout=600)
    for rank, (rc, _, err) in enumerate(procs):
        assert rc == 0, f"rank {rank} exited {rc}:\n{err[-4000:]}"
    records = {r["family"]: r for r in json.loads((tmp_path / "rank0.json").read_text())}
    assert list(records) == ["gemma2", "llama", "mistral", "qwen2"]
    failed = failures(list(records.values()))
    assert list(failed) == ["llama", "qwen2"], failed
    assert records["llama"]["outcome"] == "differs", records["llama"]
    assert records["llama"]["max_diff"] > 1e3 * records["llama"]["tolerance"], records["llama"]
    assert records["qwen2"]["outcome"] == "crash" and "deliberate fault" in failed["qwen2"], failed
    assert "HF_CONTEXTPAR_FAMILIES=llama,qwen2 " in report(failed)
