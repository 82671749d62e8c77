"""report.json (machine-readable), report.md (a table a person reads) and PNG plots."""

from __future__ import annotations

import json
import os

FILES = ("report.json", "report.md", "heatmap.png", "logit_diff.png")
TASK_TITLES = {"single_retrieval": "Single-needle retrieval", "multi_retrieval": "Multi-needle retrieval",
               "multi_reasoning": "Multi-needle reasoning"}


def _cell(text, width=60) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= width else text[: width - 1] + "…"


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return "0" if x == 0 else f"{x:.3g}"
    return str(x)


def summarize(records: list, base: dict, tol: float) -> dict:
    """The overall verdict and the worst differences; `base` holds the run's settings."""
    worst = max(records, key=lambda r: r["max_logit_diff"]) if records else None
    bad = [r["key"] for r in records if not r["equivalent"]]
    s = dict(base, verdict="equivalent" if records and not bad else "not equivalent", cases=len(records),
             equivalent_cases=len(records) - len(bad), not_equivalent=bad, tolerance=tol,
             worst_logit_diff=worst["max_logit_diff"] if worst else None, worst_case=worst["key"] if worst else None)
    if records and "tokens_identical" in records[0]:
        s["tokens_identical_cases"] = sum(r["tokens_identical"] for r in records)
        s["near_tie_divergences"] = [r["key"] for r in records if r.get("near_tie")]
        s["scores"] = {t: dict(reference=_mean([r["ref_score"] for r in records if r["task"] == t]),
                               context_parallel=_mean([r["cp_score"] for r in records if r["task"] == t]))
                       for t in dict.fromkeys(r["task"] for r in records)}
    if records and "max_nll_diff" in records[0]:
        s["worst_nll_diff"] = max(r["max_nll_diff"] for r in records)
        s["min_argmax_agreement"] = min(r["argmax_agreement"] for r in records)
    return s


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def summary_lines(s: dict) -> list[str]:
    lines = [f"{s['kind']}: {s['verdict'].upper()}  ({s['equivalent_cases']}/{s['cases']} cases within tolerance"
             + (f", {s['tokens_identical_cases']}/{s['cases']} with identical tokens" if "tokens_identical_cases" in s else "")
             + ")",
             f"  model {s['model']}  dtype {s['dtype']}  processes {s['world']}  strategy {s['strategy']}",
             f"  data {s['source']}",
             f"  reference {s['reference']}",
             f"  worst max|logit diff| {_fmt(s['worst_logit_diff'])} ({s['worst_case']})  tolerance {s['tolerance']:.3g} "
             f"({s['tolerance_rule']})"]
    if "worst_nll_diff" in s:
        lines.append(f"  worst max|NLL diff| {_fmt(s['worst_nll_diff'])}  lowest argmax agreement {s['min_argmax_agreement']:.4f}")
    for task, sc in s.get("scores", {}).items():
        lines.append(f"  {task}: mean score reference {sc['reference']:.1f}  context-parallel {sc['context_parallel']:.1f}")
    if s.get("near_tie_divergences"):
        lines.append(f"  divergences at near-ties (reference margin <= 2 x tolerance): {len(s['near_tie_divergences'])}"
                     + ("; accepted (--allow-near-ties)" if s.get("allow_near_ties") else "; rerun with --allow-near-ties to accept them"))
    if s["not_equivalent"]:
        lines.append(f"  not equivalent: {', '.join(s['not_equivalent'][:10])}" + (" ..." if len(s["not_equivalent"]) > 10 else ""))
    if s.get("warning"):
        lines.append(f"  warning: {s['warning']}")
    lines.append(f"  {s['wall_seconds']:.1f} s")
    return lines


def write(out_dir: str, summary: dict, records: list) -> list[str]:
    """Write every report file; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, "report.json"), os.path.join(out_dir, "report.md")]
    with open(paths[0], "w") as f:
        json.dump(dict(summary=summary, cases=records), f, indent=1, allow_nan=True)
    with open(paths[1], "w") as f:
        f.write(_markdown(summary, records))
    paths += _plots(out_dir, summary, records)
    return paths


def _markdown(s: dict, records: list) -> str:
    out = [f"# hf-contextpar exactness: {s['kind']}", "",
           f"**Verdict: {s['verdict']}** — context parallelism on {s['world']} processes versus the unpatched model on one process.",
           "", "```", *summary_lines(s), "```", ""]
    if s["kind"] == "needlebench":
        out += ["A case is equivalent when the generated tokens are identical and the max |logit diff| over the generated "
                "steps (up to and including the first divergent one) is within the tolerance. *Margin* is how much the "
                "reference preferred its token over the context-parallel one at the first divergent step (a near-tie when "
                "at most twice the tolerance). Scores are NeedleBench's keyword scores in %.", "",
                "| task | length | depth % | prompt tokens | identical | first divergence (margin) | max \\|Δlogit\\| | equivalent "
                "| score ref | score CP | answer (reference) | answer (context-parallel) |",
                "|---|---:|---:|---:|:---:|---:|---:|:---:|---:|---:|---|---|"]
        for r in records:
            out.append(f"| {r['task']} | {r['length']} | {r['depth']} | {r['prompt_tokens']} | {'yes' if r['tokens_identical'] else '**no**'} "
                       f"| {_fmt(r['first_divergence'])}{'' if r.get('divergence_margin') is None else ' (' + _fmt(r['divergence_margin']) + ')'} "
                       f"| {_fmt(r['max_logit_diff'])} | {'yes' if r['equivalent'] else '**no**'} "
                       f"| {r['ref_score']:.0f} | {r['cp_score']:.0f} | {_cell(r['ref_answer'])} | {_cell(r['cp_answer'])} |")
        out += ["", "![score and identity heatmaps](heatmap.png)", "", "![logit difference vs length](logit_diff.png)", ""]
    else:
        out += ["A window is equivalent when the max |logit diff| over all its positions is within the tolerance.", "",
                "| window | tokens | max \\|Δlogit\\| | max \\|ΔNLL\\| | perplexity ref | perplexity CP | argmax agreement | equivalent |",
                "|---:|---:|---:|---:|---:|---:|---:|:---:|"]
        for r in records:
            out.append(f"| {r['window']} | {r['tokens']} | {_fmt(r['max_logit_diff'])} | {_fmt(r['max_nll_diff'])} "
                       f"| {r['ppl_ref']:.6g} | {r['ppl_cp']:.6g} | {r['argmax_agreement']:.4f} | {'yes' if r['equivalent'] else '**no**'} |")
        out += ["", "![logit and NLL differences per window](logit_diff.png)", ""]
    return "\n".join(out)


def _plots(out_dir: str, s: dict, records: list) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LinearSegmentedColormap, ListedColormap

    floor = 1e-20  # an exact 0 is drawn here on log axes
    paths = []
    if s["kind"] == "needlebench":
        tasks = list(dict.fromkeys(r["task"] for r in records))
        lengths = sorted({r["length"] for r in records})
        depths = sorted({r["depth"] for r in records})
        by = {(r["task"], r["length"], r["depth"]): r for r in records}
        score_cmap = LinearSegmentedColormap.from_list("needlebench", ["#F0496E", "#EBB839", "#0CD79F"])
        fig, axes = plt.subplots(2, len(tasks), figsize=(max(4.5, 1.1 * len(lengths) + 2.5) * len(tasks), 2 * (0.45 * len(depths) + 1.8)),
                                 squeeze=False)
        for j, task in enumerate(tasks):
            score = [[by[(task, L, d)]["cp_score"] for L in lengths] for d in depths]
            ok = [[1.0 if by[(task, L, d)]["equivalent"] else 0.0 for L in lengths] for d in depths]
            for ax, grid, cmap, title in ((axes[0][j], score, score_cmap, f"{TASK_TITLES.get(task, task)}\nCP score"),
                                          (axes[1][j], ok, ListedColormap(["#F0496E", "#0CD79F"]), "equivalent to one process\n(= same tokens, ≠@k diverged at step k; max |Δlogit|)")):
                ax.imshow(grid, cmap=cmap, vmin=0, vmax=100 if grid is score else 1, aspect="auto")
                ax.set_xticks(range(len(lengths)), [str(L) for L in lengths])
                ax.set_yticks(range(len(depths)), [f"{d}%" for d in depths])
                ax.set_xlabel("context length (tokens)")
                ax.set_ylabel("needle depth")
                ax.set_title(title, fontsize=10)
                for yi, d in enumerate(depths):
                    for xi, L in enumerate(lengths):
                        r = by[(task, L, d)]
                        label = (f"{r['cp_score']:.0f}" + ("" if r["cp_score"] == r["ref_score"] else f"\n(ref {r['ref_score']:.0f})")
                                 if grid is score else ("=" if r["tokens_identical"] else f"≠@{r['first_divergence']}")
                                 + f"\n{r['max_logit_diff']:.0e}")
                        ax.text(xi, yi, label, ha="center", va="center", fontsize=7)
        fig.suptitle(f"{s['model']} · {s['dtype']} · N={s['world']} · {s['verdict']}", fontsize=11)
        fig.tight_layout()
        paths.append(os.path.join(out_dir, "heatmap.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

        fig, ax = plt.subplots(figsize=(6.5, 4))
        for task in tasks:
            xs = [r["length"] for r in records if r["task"] == task]
            ys = [max(r["max_logit_diff"], floor) for r in records if r["task"] == task]
            ax.scatter(xs, ys, s=14, alpha=0.6)
            ax.plot(lengths, [max(max(by[(task, L, d)]["max_logit_diff"] for d in depths), floor) for L in lengths],
                    marker="o", label=f"{task} (max over depths)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(L) for L in lengths])
        ax.minorticks_off()
        ax.set_xlabel("context length (tokens)")
    else:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        xs = [r["window"] for r in records]
        ax.plot(xs, [max(r["max_logit_diff"], floor) for r in records], marker="o", label="max |Δlogit|")
        ax.plot(xs, [max(r["max_nll_diff"], floor) for r in records], marker="s", label="max |ΔNLL| per token")
        ax.set_xlabel(f"window ({records[0]['tokens'] if records else 0} tokens each)")
        ax.set_xticks(xs)
    ax.axhline(s["tolerance"], color="red", linestyle="--", linewidth=1, label=f"tolerance {s['tolerance']:.0e}")
    ax.set_yscale("log")
    ax.set_ylabel(f"difference vs one process (0 drawn at {floor:.0e})")
    ax.set_title(f"{s['model']} · {s['dtype']} · N={s['world']}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "logit_diff.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
