"""`eval csa --exact-strategies`: CSA's prefill beside every exact strategy's, on the same prompts, in one run.

The issue's bar for the approximate mode is a time to first token below the *fastest* exact strategy's, not
only below whatever `strategy="auto"` picks. So besides the exact run that checks exactness (`--strategy`,
'auto' by default), each exact prefill strategy that applies to this model and N runs the same prompts, one
setting after the other as the others do (a strategy the library refuses here, Ulysses where N does not
divide the heads, is listed with its reason). They are timed only: their tokens are not compared, since the
exactness of every strategy is the exactness suite's business, and the one exact run of the report already
checks this model against one process. The report gives each run's prefill seconds per rank (mean over the
prompts), the slowest rank's, per prompt length too, and names the fastest exact run.
"""

from __future__ import annotations

import hf_contextpar
from hf_contextpar.plan.strategies import prefill_names

CSA_RUN = "csa"
CSA_EVEN = "csa_even_partitions"  # CSA on even partitions (partitions="even"), beside its balanced default


def exact_strategies(text: str | None) -> list[str]:
    """--exact-strategies: none (the exact run alone), 'all' (every exact prefill strategy) or a list of them."""
    if not text or text == "none":
        return []
    known = list(prefill_names())
    names = known if text == "all" else [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in known]
    if bad:
        raise SystemExit(f"error: --exact-strategies: unknown {bad}; the exact prefill strategies are {known} (or all)")
    return names


def time_strategies(d, names, run) -> tuple[dict, dict]:
    """({strategy: its runs}, {strategy: why it was skipped}): `run(how)` is `distributed_runs` over the report's
    prompts without results. A refusal at apply is the same on every rank, so every rank skips it alike."""
    timed, skipped = {}, {}
    for name in names:
        try:
            timed[name] = run(dict(strategy=name))
        except hf_contextpar.ContextParallelError as e:
            skipped[name] = f"{type(e).__name__}: {e}"
            d.barrier()
    return timed, skipped


def strategy_summary(cases, runs: dict, exact_label: str, skipped: dict) -> dict:
    """Per run (the exact strategies, the exact run under its label, CSA): prefill seconds per rank and the slowest
    rank's (means over the prompts), per prompt length as well; the fastest exact run, and CSA against it."""
    per_rank = {name: _mean_rows([r["ttft_s"] for r in rs]) for name, rs in runs.items()}
    slowest = {name: _mean([max(r["ttft_s"]) for r in rs]) for name, rs in runs.items()}
    bytes_sent = {name: sum(sum(r["bytes_sent"]) for r in rs) for name, rs in runs.items()}
    groups = {}
    for i, c in enumerate(cases):
        groups.setdefault(c.get("length") or f"window ({len(c['ids'])})", []).append(i)
    by_length = {
        str(g): {name: _mean([max(rs[i]["ttft_s"]) for i in idx]) for name, rs in runs.items()}
        for g, idx in groups.items()
    }
    exact = {name: s for name, s in slowest.items() if name not in (CSA_RUN, CSA_EVEN)}
    fastest = min(exact, key=exact.get) if exact else None
    return dict(
        exact_run=exact_label,
        prefill_s_per_rank=per_rank,
        prefill_s_slowest=slowest,
        prefill_s_slowest_by_length=by_length,
        bytes_sent_by_run=bytes_sent,
        fastest_exact=fastest,
        fastest_exact_by_length={g: min((n for n in v if n in exact), key=v.get) for g, v in by_length.items()},
        csa_over_fastest_exact=slowest[CSA_RUN] / exact[fastest] if fastest and exact[fastest] else None,
        skipped_strategies=skipped,
    )


def strategy_lines(s: dict) -> list[str]:
    """report.md's section: every run's prefill seconds per rank beside CSA's, and per prompt length."""
    runs = list(s["prefill_s_per_rank"])
    world = len(next(iter(s["prefill_s_per_rank"].values())))
    lines = [
        "",
        "## Prefill per rank: CSA beside every exact strategy",
        "",
        f"Same prompts, one setting after the other; seconds, mean over the prompts. Exact run: {s['exact_run']}. "
        f"Fastest exact: **{s['fastest_exact']}**; CSA / fastest exact (slowest rank): "
        f"{_fmt(s['csa_over_fastest_exact'], '.3f')}.",
        "",
        "| run | " + " | ".join(f"rank {r}" for r in range(world)) + " | slowest rank | bytes sent (all ranks) |",
        "|---|" + "---:|" * (world + 2),
    ]
    for name in runs:
        cells = " | ".join(f"{t:.3f}" for t in s["prefill_s_per_rank"][name])
        mark = " (fastest exact)" if name == s["fastest_exact"] else ""
        lines.append(
            f"| {name}{mark} | {cells} | {s['prefill_s_slowest'][name]:.3f} | {s['bytes_sent_by_run'][name]} |"
        )
    lines += ["", "Slowest rank's prefill seconds per prompt length:", ""]
    lines += ["| length | " + " | ".join(runs) + " | fastest exact |", "|---|" + "---:|" * len(runs) + "---|"]
    for g, v in s["prefill_s_slowest_by_length"].items():
        lines.append(f"| {g} | " + " | ".join(f"{v[n]:.3f}" for n in runs) + f" | {s['fastest_exact_by_length'][g]} |")
    for name, why in s["skipped_strategies"].items():
        lines.append(f"\n- skipped {name}: {why}")
    return lines


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def _mean_rows(rows):
    return [_mean(col) for col in zip(*rows)]


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)
