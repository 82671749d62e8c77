"""Tests a newcomer can aim (issue 57): the area markers of tests/areas.py and what a selection does to the rotation.

- Every module of the installed packages is a source of some area, and every area's tests exist: a new module
  without tests, or a renamed test, fails here (and a renamed test fails every run's collection, tests/conftest.py).
- Every area marker selects tests on every day of the rotation, and every entry of the table selects some test.
- A run that names its tests (`-k`, a node id) rotates nothing; `HF_CONTEXTPAR_SLICE=k` replays slice k whatever
  else is asked; `-m` and file paths keep the day's slice (an area's matrices rotate as they do in CI).
- `python tests/areas.py FILE` names the markers of a file and the command that runs them.
"""

from __future__ import annotations

import datetime
import fnmatch
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import areas
import conftest
import pytest


def _pytest(*args: str, env: dict | None = None, plugin_dir: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m pytest ARGS` from the repository root, the same package on the path, the header printed."""
    env = {**{k: v for k, v in os.environ.items() if k != "HF_CONTEXTPAR_SLICE"}, **(env or {})}
    paths = [str(plugin_dir)] if plugin_dir else []
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(areas.ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", *args]
    return subprocess.run(cmd, cwd=areas.ROOT, env=env, capture_output=True, text=True, timeout=300)


def _selected(out: subprocess.CompletedProcess) -> list[str]:
    assert out.returncode in (0, 5), out.stdout[-3000:] + out.stderr[-3000:]
    return [line for line in out.stdout.splitlines() if line.startswith("tests/") and "::" in line]


def test_every_module_is_in_an_area():
    missing = [f for f in areas.source_files() if not areas.areas_of(f)]
    assert not missing, (
        f"modules in no area of tests/areas.py: {missing}; add each to the area whose tests cover it (or a new "
        "area with its tests)"
    )


def test_every_source_named_exists():
    files = areas.source_files()
    dead = [p for a in areas.AREAS.values() for p in a.sources if not fnmatch.filter(files, p)]
    assert not dead, f"tests/areas.py names sources that match no module: {dead}"


def test_every_test_named_exists():
    stale = [
        f"{module}::{function}" if function else module
        for _, module, function, _ in areas.ENTRIES
        if not areas.defines(module, function)
    ]
    assert not stale, f"tests/areas.py names tests that do not exist: {stale}"


def test_every_test_file_is_in_an_area():
    """So the table answers the other way round too: what a test file covers."""
    named = {module for _, module, _, _ in areas.ENTRIES}
    missing = sorted(str(p.relative_to(areas.ROOT)) for p in areas.test_files() if p.name not in named)
    assert not missing, f"test files in no area of tests/areas.py: {missing}"


def test_the_markers_are_registered(request):
    registered = {line.split(":")[0].strip() for line in request.config.getini("markers")}
    assert set(areas.MARKERS) <= registered


DUMP = """
import json, os, sys
import pytest

@pytest.hookimpl(trylast=True)  # after the rotation (tests/conftest.py) and -k
def pytest_collection_modifyitems(config, items):
    rules = sys.modules["conftest"]
    rows = []
    for item in items:
        name = getattr(item, "originalname", None) or item.name
        params = item.callspec.params if hasattr(item, "callspec") else {}
        out = [k for k in range(rules.SLICES) if rules._rotated_out(item.path.name, name, params, k)]
        markers = sorted(m.name for m in item.iter_markers())
        entries = sys.modules["areas"].entries_of(item.path.name, name, params)
        rows.append(dict(node=item.nodeid, markers=markers, entries=entries, rotated_out=out))
    with open(os.environ["AREAS_DUMP"], "w") as f:
        json.dump(rows, f)
"""


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
    """Every test of the suite with its markers and the slices that rotate it out, from one collection that selects
    with `-k test` (every test's name has it): a run that names its tests rotates nothing, so every slice is here."""
    where = tmp_path_factory.mktemp("areas")
    (where / "areas_dump.py").write_text(DUMP)
    dump = where / "items.json"
    out = _pytest("-p", "areas_dump", "-k", "test", env={"AREAS_DUMP": str(dump)}, plugin_dir=where)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout, json.loads(dump.read_text())


def test_a_keyword_selection_is_not_rotated(collected):
    """What the day's rotation would drop is still selected under -k, docs/testing.md's example among it."""
    stdout, rows = collected
    assert "hf-contextpar rotation: every slice" in stdout
    assert sum(1 for r in rows if r["rotated_out"]) > 300  # the rotating matrices, every slice of them
    assert [r for r in rows if "test_exact[N3-gemma2-" in r["node"]]


def test_a_node_id_is_not_rotated():
    """A node id that today's slice rotates out still runs."""
    today = datetime.date.today().toordinal() % conftest.SLICES  # the child runs without HF_CONTEXTPAR_SLICE
    node = next(
        f"tests/multi_process/test_exactness.py::test_exact[N{n}-{family}-greedy]"
        for n in (3, 4)
        for family in ("gemma2", "llama", "qwen3", "mistral")
        if conftest._rotated_out("test_exactness.py", "test_exact", dict(n=n, family=family), today)
    )
    assert _selected(_pytest(node)) == [node]


def test_every_area_selects_tests_on_every_day(collected):
    _, rows = collected
    empty = [
        (marker, k)
        for marker in areas.MARKERS
        for k in range(conftest.SLICES)
        if not any(marker in row["markers"] and k not in row["rotated_out"] for row in rows)
    ]
    assert not empty, f"area markers that select nothing in a slice of the rotation (marker, slice): {empty}"


def test_every_entry_selects_a_test(collected):
    """A predicate that matches no parameter set (a renamed family or strategy) is as stale as a renamed test."""
    _, rows = collected
    used = {i for r in rows for i in r["entries"]}
    dead = [entry[:3] for i, entry in enumerate(areas.ENTRIES) if i not in used]
    assert not dead, f"entries of tests/areas.py that select no test (marker, module, function): {dead}"


def _config(keyword: str = "", markexpr: str = "", args: tuple[str, ...] = ()):
    return SimpleNamespace(option=SimpleNamespace(keyword=keyword, markexpr=markexpr), args=list(args))


@pytest.mark.parametrize("day", range(conftest.SLICES))
def test_a_named_selection_rotates_nothing_on_any_day(day, monkeypatch):
    today = datetime.date.fromordinal(738000 + day)
    monkeypatch.setattr(conftest, "datetime", SimpleNamespace(date=SimpleNamespace(today=lambda: today)))
    monkeypatch.delenv("HF_CONTEXTPAR_SLICE", raising=False)
    dated = today.toordinal() % conftest.SLICES
    # the day's slice: a plain run, a file, a marker expression
    assert conftest.rotation_slice(_config()) == dated
    assert conftest.rotation_slice(_config(args=("tests/multi_process/test_exactness.py",))) == dated
    assert conftest.rotation_slice(_config(markexpr="ring_pass_kv")) == dated
    # every slice: -k, a node id
    assert conftest.rotation_slice(_config(keyword="N3 and gemma2")) is None
    assert (
        conftest.rotation_slice(_config(args=("tests/multi_process/test_exactness.py::test_exact[N3-gemma2-greedy]",)))
        is None
    )
    assert conftest.rotation_slice(_config(keyword="gemma2", markexpr="ring_pass_kv")) is None
    # HF_CONTEXTPAR_SLICE wins over everything: k replays slice k, all runs every slice
    monkeypatch.setenv("HF_CONTEXTPAR_SLICE", str((dated + 1) % conftest.SLICES))
    assert conftest.rotation_slice(_config(keyword="N3 and gemma2")) == (dated + 1) % conftest.SLICES
    monkeypatch.setenv("HF_CONTEXTPAR_SLICE", "all")
    assert conftest.rotation_slice(_config()) is None


@pytest.mark.parametrize(
    "path,marker",
    [("hf_contextpar/attention/ring_pass_kv.py", "ring_pass_kv"), ("hf_contextpar/cache/recurrent.py", "recurrent")],
)
def test_the_command_names_a_files_markers(path, marker, capsys):
    assert areas.main([path]) == 0
    out = capsys.readouterr().out
    assert f"{path}: {marker}" in out and f'python -m pytest -q -m "{marker}"' in out
    assert areas.main([str(areas.ROOT / path)]) == 0  # an absolute path too
    assert areas.main(["hf_contextpar/no_such_module.py"]) == 1
