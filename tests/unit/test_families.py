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

This file holds the checks that run in the pytest process; the ones that launch ranks are in tests/multi_process/test_families.py.
"""

from __future__ import annotations

from family_worker import families
from hf_contextpar.patches.verified import VERIFIED

ALL = [f["family"] for f in families()]


def test_every_verified_model_type_is_checked():
    """Each model type VERIFIED lists is built by at least one census family the worker runs (no stale entry)."""
    assert {f["key"] for f in families()} == set(VERIFIED)
    assert len(ALL) == len(set(ALL))
