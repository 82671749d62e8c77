"""The model census (dev/census/run.py, docs/census.json): every decoder-only text family of
the installed transformers is classified, what it generates is what is committed, and a rotating few still
get their committed classification at N = 2, 3 and 4.

This file holds the checks that launch ranks (tests/launch.py); the others, and the feature's whole description, are in
tests/unit/test_census.py.
"""

from __future__ import annotations

import datetime
import json
import os
import random

import pytest
from areas import ROOT  # the repository root
from launch import launch

from dev.census import report as census_report

CENSUS = os.path.join(ROOT, "docs", "census.json")
DRAW, SWEEP_DRAW = 6, 2


def _committed() -> dict:
    with open(CENSUS) as f:
        return json.load(f)


def _draw(report: dict, salt: str = "", k: int = DRAW) -> list[str]:
    chosen = os.environ.get("HF_CONTEXTPAR_CENSUS_FAMILIES")
    if chosen and salt:  # the chosen ones the committed sweep has
        return [f for f in chosen.split(",") if any(f in s["families"] for s in report.get("sweep", {}).values())]
    if chosen:
        return chosen.split(",")
    rng = random.Random(f"{datetime.date.today().toordinal()}{salt}")
    recs = sorted(report["families"], key=lambda r: r["family"])
    if salt:  # the sweep: verified families that are quick
        pool = [r["family"] for r in recs if census_report.verdict(report, r)[0] and r.get("seconds", 0) < 10]
        return rng.sample(pool, k)
    # the verified families run every day in tests/*/test_families.py: here the refused and skipped ones, whose
    # outcome only the census itself reports (one that now runs, or fails otherwise, must be re-classified)
    pool = [r["family"] for r in recs if not census_report.verdict(report, r)[0]]
    return rng.sample(pool, min(k, len(pool)))


def _run(world: int, args: list[str], out) -> dict:
    procs = launch(world, ["-m", "dev.census", *args, "--json", str(out)], timeout=600)
    for rank, (rc, _, err) in enumerate(procs):
        assert rc == 0, f"rank {rank} exited {rc}:\n{err[-4000:]}"
    return json.loads(out.read_text())


def _census_changes(report: dict, families: list[str], tmp_path) -> dict:
    now = {r["family"]: r for r in _run(2, ["--families", ",".join(families)], tmp_path / "c.json")["families"]}
    committed = {r["family"]: r for r in report["families"]}
    changed = {}
    for f in families:
        r = now[f]
        if r["outcome"] != committed[f]["outcome"]:
            why = f" (max diff {r['max_diff']:.1e})" if "max_diff" in r else ""
            changed[f] = f"{committed[f]['outcome']} -> {r['outcome']}{why}" + (
                f": {r['error']['last_line']}" if r.get("error") else ""
            )
        elif census_report.verdict(report, committed[f])[0] and r.get("registered_by_census"):
            changed[f] = "verified, but the census had to register it by hand (no opt-in broken)"
    return changed


def _sweep_changes(report: dict, world: int, families: list[str], tmp_path) -> dict:
    args = ["--sweep", "--base", CENSUS, "--families", ",".join(families)]
    now = _run(world, args, tmp_path / "s.json")["sweep"][str(world)]["families"]
    committed = report["sweep"][str(world)]["families"]
    changed = {}
    for f in families:
        for name, v in committed.get(f, {}).get("variants", {}).items():
            got = now[f].get("variants", {}).get(name, now[f])
            if got.get("outcome") != v["outcome"]:
                changed[f"{f} {name}"] = f"{v['outcome']} -> {got.get('outcome')} {got.get('error', '')}"
    return changed


@pytest.mark.parametrize("world", [2, 3, 4])
def test_rotating_families_keep_their_classification(world, tmp_path):
    report = _committed()
    changed, drawn = {}, []
    if world == 2:
        drawn = _draw(report)
        changed.update(_census_changes(report, drawn, tmp_path))
    swept = _draw(report, salt=f"sweep{world}", k=SWEEP_DRAW)
    if swept:
        changed.update(_sweep_changes(report, world, swept, tmp_path))
    assert not changed, (
        f"census classifications changed (drawn: HF_CONTEXTPAR_CENSUS_FAMILIES={','.join(drawn or swept)}; swept at "
        f"N = {world}: {','.join(swept)}): {changed}. If the change is intended (a fix), re-run the census for them "
        "and commit docs/census.* and patches/verified.py"
    )
