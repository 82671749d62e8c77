"""The model census (dev/census/run.py, docs/census.json): every decoder-only text family of
the installed transformers is classified, what it generates is what is committed, and a rotating few still
get their committed classification at N = 2, 3 and 4.

(a) The model types transformers maps to AutoModelForCausalLM, after the census's stated filters, are
exactly the families of docs/census.json (and the dropped ones its `excluded`): a transformers release
that adds a family fails here until the census is re-run and committed.
(b) patches/verified.py (the families that run with no opt-in), docs/census.md and README's block are what
docs/census.json generates: nobody verifies a family by hand-editing the list. A verified family resolves
with no registration; any other is refused with what the census found.
(c) A rotating subset re-runs: at N = 2 six of the families the census does not verify (refused or skipped),
drawn by the day, through the census (every verified family runs every day in tests/*/test_families.py); at N = 2, 3 and 4 two verified families each through the
sweep (every prefill strategy, both decode modes, padded batches), each variant against its committed
outcome. HF_CONTEXTPAR_CENSUS_FAMILIES=a,b picks the families instead (a failure names the day's draw).

This file holds the checks that run in the pytest process; the ones that launch ranks are in tests/multi_process/test_census.py.
"""

from __future__ import annotations

import json
import os

import pytest
from areas import ROOT  # the repository root

from dev.census import report as census_report
from dev.census.configs import scope
from hf_contextpar import patches
from hf_contextpar.errors import UnsupportedModelError

CENSUS = os.path.join(ROOT, "docs", "census.json")


def _committed() -> dict:
    with open(CENSUS) as f:
        return json.load(f)


def _read(*path) -> str:
    with open(os.path.join(ROOT, *path), encoding="utf-8") as f:
        return f.read()


def test_every_causal_lm_family_is_classified():
    families, dropped = scope()
    report = _committed()
    committed = {r["family"] for r in report["families"]}
    new, gone = sorted(set(families) - committed), sorted(committed - set(families))
    assert not new, (
        f"transformers maps these model types to AutoModelForCausalLM and the census has not classified them: "
        f"{new}. Run `torchrun --nproc_per_node 2 -m dev.census --families {','.join(new)} "
        "--json docs/census.json --resume` (and --sweep at 2, 3 and 4 processes), then regenerate docs/census.md, "
        "patches/verified.py and README's block (`--from-json`, docs/testing.md), and commit them."
    )
    assert not gone, f"docs/census.json classifies model types this transformers does not have: {gone}"
    assert set(dropped) == set(report["excluded"]), "the census's filters drop other model types than committed"
    assert not report.get("partial"), f"docs/census.json is a partial run: {report['partial']}"
    exact = {r["family"] for r in report["families"] if r["outcome"] == "exact"}
    for world in census_report.SWEEP_WORLDS:
        swept = set(report.get("sweep", {}).get(world, {}).get("families", {}))
        assert exact <= swept, f"families exact in the census but not swept at N = {world}: {sorted(exact - swept)}"


def test_generated_files_are_the_census():
    report = _committed()
    fix = "python -m dev.census --from-json docs/census.json --markdown docs/census.md --verified patches/verified.py --readme README.md"
    assert _read("patches", "verified.py") == census_report.verified_module(report), f"regenerate: {fix}"
    assert _read("docs", "census.md") == census_report.markdown(report), f"regenerate: {fix}"
    assert census_report.readme_block(report) in _read("README.md"), f"regenerate: {fix}"


def test_verified_families_need_no_opt_in_and_the_rest_are_refused():
    from hf_contextpar.patches.verified import NOT_VERIFIED, VERIFIED

    report = _committed()
    assert VERIFIED, "the census verified no family"
    for r in report["families"]:
        ok, why = census_report.verdict(report, r)
        if r["outcome"] != "exact":
            assert not ok
    for mt, (tol, attn) in VERIFIED.items():  # in the registry: as the census found it, or a hand entry's
        patch = patches.resolve(type("Config", (), dict(model_type=mt))())
        assert not patch.census or (patch.fp64_tolerance, patch.reference_attn) == (tol, attn), mt
    for mt, why in NOT_VERIFIED.items():
        if mt in patches.REGISTRY or mt in patches.INEXACT:  # a hand entry, or refused whatever the census says
            continue
        with pytest.raises(UnsupportedModelError, match="model census") as e:
            patches.resolve(type("Config", (), dict(model_type=mt))())
        assert why[:40] in str(e.value), (mt, str(e.value))
    with pytest.raises(UnsupportedModelError, match="not in the model census"):
        patches.resolve(type("C", (), dict(model_type="a_future_family"))())


def test_inexact_families_are_refused_even_when_registered(monkeypatch):
    """A family whose attention the library cannot serve exactly stays refused after a user's register()."""
    assert patches.INEXACT
    for mt, why in patches.INEXACT.items():
        monkeypatch.setitem(patches.REGISTRY, mt, patches.FamilyPatch(mt, "a user's opt-in"))
        with pytest.raises(UnsupportedModelError, match="registered or not") as e:
            patches.resolve(type("Config", (), dict(model_type=mt))())
        assert why in str(e.value)
