"""The model census (hf_contextpar/tools/census.py, docs/census.json): every decoder-only text family of
the installed transformers is classified, and a rotating few still get their committed classification.

(a) The model types transformers maps to AutoModelForCausalLM, after the census's stated filters, are
exactly the families of docs/census.json (and the dropped ones its `excluded`): a transformers release
that adds a family fails here until the census is re-run and committed.
(b) A rotating subset (llama, a refused family and six others, drawn by the day's date) re-runs at N = 2
in one launch and must give the committed outcome (about 45 s on 2 cores). HF_CONTEXTPAR_CENSUS_FAMILIES=a,b picks the
families instead (a failure message names the day's draw, so it can be re-run).
"""

from __future__ import annotations

import datetime
import json
import os
import random

from launch import launch

from hf_contextpar.tools.census import scope

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CENSUS = os.path.join(ROOT, "docs", "census.json")
DRAW = 6
ALWAYS = ["llama"]


def _committed() -> dict:
    with open(CENSUS) as f:
        return json.load(f)


def test_every_causal_lm_family_is_classified():
    families, dropped = scope()
    report = _committed()
    committed = {r["family"] for r in report["families"]}
    new, gone = sorted(set(families) - committed), sorted(committed - set(families))
    assert not new, (
        f"transformers maps these model types to AutoModelForCausalLM and the census has not classified them: "
        f"{new}. Run `torchrun --nproc_per_node 2 -m hf_contextpar.tools.census --families {','.join(new)} "
        "--json docs/census.json --resume`, then regenerate docs/census.md (`--from-json`), and commit both."
    )
    assert not gone, f"docs/census.json classifies model types this transformers does not have: {gone}"
    assert set(dropped) == set(report["excluded"]), "the census's filters drop other model types than committed"
    assert not report.get("partial"), f"docs/census.json is a partial run: {report['partial']}"


def _draw(report: dict) -> list[str]:
    """llama, one refused family and DRAW others, drawn by the day (fp32-noise differences left out: whether
    a model-internal fp32 router rounds the same on another CPU is not the library's to keep)."""
    chosen = os.environ.get("HF_CONTEXTPAR_CENSUS_FAMILIES")
    if chosen:
        return chosen.split(",")
    rng = random.Random(datetime.date.today().toordinal())
    recs = sorted(report["families"], key=lambda r: r["family"])
    refused = rng.choice([r["family"] for r in recs if r["outcome"] == "refused"])
    pool = [
        r["family"]
        for r in recs
        if r["family"] not in (*ALWAYS, refused)
        and r.get("seconds", 0) < 10
        and "fp32 tolerance" not in r.get("note", "")
    ]
    return [*ALWAYS, refused, *rng.sample(pool, DRAW)]


def test_rotating_families_keep_their_classification(tmp_path):
    report = _committed()
    families = _draw(report)
    out = tmp_path / "census.json"
    args = ["-m", "hf_contextpar.tools.census", "--families", ",".join(families), "--json", str(out)]
    procs = launch(2, args, timeout=300)
    for rank, (rc, _, err) in enumerate(procs):
        assert rc == 0, f"rank {rank} exited {rc}:\n{err[-4000:]}"
    committed = {r["family"]: r for r in report["families"]}
    now = {r["family"]: r for r in json.loads(out.read_text())["families"]}
    changed = {
        f: f"{committed[f]['outcome']} -> {now[f]['outcome']}"
        + (f" (max diff {now[f]['max_diff']:.1e})" if "max_diff" in now[f] else "")
        + (f": {now[f]['error']['last_line']}" if now[f].get("error") else "")
        for f in families
        if now[f]["outcome"] != committed[f]["outcome"]
    }
    assert not changed, (
        f"families whose census classification changed (drawn: HF_CONTEXTPAR_CENSUS_FAMILIES={','.join(families)}): "
        f"{changed}. If the change is intended (a fix), re-run the census for them and commit docs/census.*"
    )
