"""Every verified family, exact under context parallelism, in every run (issue 57).

This file holds the checks that run in the pytest process; the others, and the feature's whole description, are in
tests/multi_process/test_families.py.
"""

from __future__ import annotations

from family_worker import families
from hf_contextpar.patches.verified import VERIFIED

ALL = [f["family"] for f in families()]


def test_every_verified_model_type_is_checked():
    """Each model type VERIFIED lists is built by at least one census family the worker runs (no stale entry)."""
    assert {f["key"] for f in families()} == set(VERIFIED)
    assert len(ALL) == len(set(ALL))
