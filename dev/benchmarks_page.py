"""docs/benchmarks.md is docs/benchmarks.template.md with the report of docs/bench.json in it:

    python -m dev.benchmarks_page > docs/benchmarks.md

The template's line `<!-- report -->` is replaced by the markdown report that `python -m hf_contextpar.bench
--report docs/bench.json` prints, its title dropped and its sections one level down, so that it sits under one
of the template's sections. Each line `<!-- table: PATH -->` becomes the table of the simulated-rank GPU run in
PATH (dev/gpu/simulated_ranks.py). Figures are regenerated, never typed (tests/unit/test_docs.py checks the page)."""

from __future__ import annotations

import argparse
import json
import re
import sys

from dev.gpu.simulated_ranks import markdown as gpu_table
from hf_contextpar.tools.bench.report import format_report

REPORT_MARKER = "<!-- report -->"


def page(json_path: str, template_path: str) -> str:
    with open(json_path, encoding="utf-8") as f:
        md = format_report(json.load(f))
    with open(template_path, encoding="utf-8") as f:
        template = f.read()
    if template.count(REPORT_MARKER + "\n") != 1:
        raise ValueError(f"{template_path} must hold the line {REPORT_MARKER!r} exactly once")
    body = md.split("\n", 1)[1].lstrip("\n")  # without "# hf-contextpar benchmark"
    body = "\n".join("#" + line if line.startswith("#") else line for line in body.split("\n"))
    return re.sub(
        r"^<!-- table: (\S+) -->\n",
        lambda m: _gpu_table(m[1]),
        template.replace(REPORT_MARKER + "\n", body),
        flags=re.M,
    )


def _gpu_table(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return gpu_table(json.load(f))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--report", default="docs/bench.json", help="the bench run's JSON (default docs/bench.json)")
    p.add_argument("--template", default="docs/benchmarks.template.md")
    args = p.parse_args(argv)
    try:
        sys.stdout.write(page(args.report, args.template))
    except (OSError, ValueError) as e:
        p.error(str(e))


if __name__ == "__main__":
    main()
