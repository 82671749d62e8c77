"""The documentation: a README for users of at most 250 lines, the pages beside it, and
docs/benchmarks.md exactly what regenerating it from the committed docs/bench.json prints."""

import os
import re
import subprocess
import sys

from areas import ROOT  # the repository root

PAGES = [
    "README.md",
    "docs/design.md",
    "docs/benchmarks.md",
    "docs/testing.md",
    "docs/tools.md",
    "hf_contextpar/assets/needle-lm/README.md",
]


def _read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def test_readme_is_short():
    lines = _read("README.md").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move details to docs/ (at most 250)"


def test_pages_exist():
    missing = [p for p in PAGES if not os.path.isfile(os.path.join(ROOT, p))]
    assert not missing, f"missing documentation pages: {missing}"


def test_relative_links_resolve():
    """Every relative link in the pages points at a file or folder of the repository."""
    broken = []
    for page in PAGES:
        text = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", _read(page), flags=re.S))  # not code
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not os.path.exists(os.path.join(ROOT, os.path.dirname(page), target)):
                broken.append(f"{page}: {target}")
    assert not broken, f"broken links: {broken}"


def test_benchmarks_page_is_generated():
    """docs/benchmarks.md is the template with the report of docs/bench.json in it, as the command in its
    header prints it: figures are regenerated, never typed."""
    command = [sys.executable, "-m", "dev.benchmarks_page"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == _read("docs/benchmarks.md"), (
        "docs/benchmarks.md differs from what the committed docs/bench.json gives; regenerate it: "
        "python -m dev.benchmarks_page > docs/benchmarks.md"
    )
