"""The exactness harness (`python -m hf_contextpar.eval`): prompt construction, and end to end on
the built-in model, offline, N=2 (CPU, gloo): it says "equivalent" for the real engine and
"not equivalent" (exit 1) for an engine with one ring step dropped."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from hf_contextpar.eval import needlebench as nb  # noqa: E402
from launch import launch  # noqa: E402

from hf_contextpar.models import byte_tokenizer  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "eval_worker.py")
SENTENCE_END = re.compile(r"[.!?](?=\s)|\n\n")


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def data():
    return nb.builtin_data()


def _check_placement(p, depths):
    """Every needle starts a sentence (or the haystack) and no sentence ends between it and its depth point."""
    haystack, removed = p.context, 0
    for needle in p.needles:
        haystack = haystack.replace(needle, "", 1)
    assert len(haystack) == len(p.context) - sum(map(len, p.needles))
    ends = [m.end() for m in SENTENCE_END.finditer(haystack)]
    for needle, at, target, depth in zip(p.needles, p.needle_at, p.target_at, depths):
        assert p.context[at : at + len(needle)] == needle
        at_h = at - removed  # offset in the haystack without the needles inserted before this one
        removed += len(needle)
        assert at_h == 0 or at_h == len(haystack) or at_h in ends, repr(haystack[at_h - 20 : at_h + 20])
        assert at_h <= target and not any(at_h < e <= target for e in ends), repr(haystack[at_h : target + 1])
        # the byte tokenizer makes haystack tokens and characters the same scale
        assert abs(target / len(haystack) - depth / 100) < 0.005, (target, len(haystack), depth)


@pytest.mark.parametrize("length", [1024, 3000])
@pytest.mark.parametrize("depth", [0, 10, 33, 50, 77, 100])
def test_single_needle_at_depth_within_one_sentence(tok, data, length, depth):
    (p,) = nb.build_cases(data, tok, ["single_retrieval"], [length], [depth])
    assert length - 24 <= len(p.ids) <= length, (len(p.ids), length)
    assert len(p.needles) == 1 and p.context.count(p.needles[0]) == 1
    _check_placement(p, [depth])
    assert p.ids == tok(p.text).input_ids
    assert p.text.rstrip().endswith(p.question) and p.keywords[0] in p.needles[0]


@pytest.mark.parametrize("task", ["multi_retrieval", "multi_reasoning"])
@pytest.mark.parametrize("length", [1500, 4096])
@pytest.mark.parametrize("depth", [0, 40, 95, 100])
def test_multi_needles_at_spaced_depths_within_budget(tok, data, task, length, depth):
    (p,) = nb.build_cases(data, tok, [task], [length], [depth], spacing=10)
    assert length - 24 <= len(p.ids) <= length, (len(p.ids), length)
    assert len(p.needles) == (3 if task == "multi_retrieval" else 2)
    _check_placement(p, [min(100, depth + 10 * i) for i in range(len(p.needles))])
    assert all(k.lower() in "".join(p.needles).lower() for k in p.keywords)
    if task == "multi_retrieval":  # NeedleBench's combined question: each question, then one answer format
        assert p.question.count("?") == 3 and re.search(
            r"format of '[^']*______、[^']*______、[^']*______'$", p.question
        )


def test_prompt_too_short_is_a_clear_error(tok, data):
    with pytest.raises(nb.DataError, match="leaves no room for a haystack"):
        nb.build_cases(data, tok, ["multi_retrieval"], [300], [50])


def test_scores():
    assert nb.score("single_retrieval", "The number is 7341.", ["7341"]) == 100
    assert nb.score("single_retrieval", "The number is 7314.", ["7341"]) == 0
    assert nb.score("multi_retrieval", "19 and copper heron", ["19", "copper heron", "Ovid"]) == pytest.approx(200 / 3)
    assert nb.score("multi_reasoning", "The garden has Saffron crocuses", ["saffron", "crocuses"]) == 100


def _report(out):
    with open(os.path.join(out, "report.json")) as f:
        rep = json.load(f)
    for name in (
        ("report.md", "heatmap.png", "logit_diff.png")
        if rep["summary"]["kind"] == "needlebench"
        else ("report.md", "logit_diff.png")
    ):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    return rep


def _check(procs, expect_rc):
    for rank, (rc, out, err) in enumerate(procs):
        assert rc == expect_rc, f"rank {rank} exited {rc} (expected {expect_rc}):\n{out[-2000:]}\n{err[-4000:]}"


def test_needlebench_equivalent_n2(tmp_path):
    out = tmp_path / "nb"
    procs = launch(
        2,
        [
            "-m",
            "hf_contextpar.eval",
            "needlebench",
            "--model",
            "tiny-llama",
            "--lengths",
            "1024",
            "--depths",
            "0,50,100",
            "--max-new-tokens",
            "6",
            "--needles",
            "0,3",
            "--out",
            str(out),
        ],
        timeout=300,
    )
    _check(procs, 0)
    assert "needlebench: EQUIVALENT" in procs[0][1] and procs[1][1] == ""  # rank 0 reports, the others stay quiet
    rep = _report(out)
    s = rep["summary"]
    # single_retrieval: one prompt per listed needle in every cell; the other tasks one each
    assert s["verdict"] == "equivalent" and s["world"] == 2 and s["cases"] == 12 and s["tolerance"] == 1e-4
    assert sorted((c["task"], c["depth"], c["needle"]) for c in rep["cases"]) == sorted(
        [("single_retrieval", d, i) for d in (0, 50, 100) for i in (0, 3)]
        + [(t, d, None) for t in nb.TASKS[1:] for d in (0, 50, 100)]
    )
    assert len({c["key"] for c in rep["cases"]}) == 12
    for c in rep["cases"]:
        assert c["tokens_identical"] and c["first_divergence"] is None and c["max_logit_diff"] <= 1e-4
        assert c["ref_answer"] == c["cp_answer"] and c["new_tokens"] == [6, 6] and c["prompt_tokens"] <= 1024
    md = open(out / "report.md").read()
    assert "**Verdict: equivalent**" in md and md.count("| single_retrieval |") == 6


def test_needlebench_replicas_write_the_single_groups_report(tmp_path):
    """4 processes as 2 replicas of CP 2 (`--cp-size 2`): each replica runs half the cases, and the one report
    rank 0 writes is the report of one CP group of 2 running them all (the same answers, the same logits)."""
    args = ["-m", "hf_contextpar.eval", "needlebench", "--model", "tiny-llama", "--lengths", "1024"]
    args += ["--depths", "0,50,100", "--max-new-tokens", "6", "--needles", "0,3"]
    one, two = tmp_path / "one", tmp_path / "two"
    _check(launch(2, [*args, "--out", str(one)], timeout=300), 0)
    procs = launch(4, [*args, "--cp-size", "2", "--out", str(two)], timeout=300)
    _check(procs, 0)
    assert all(out == "" for _, out, _ in procs[1:])  # rank 0 reports
    single, replicas = _report(one), _report(two)
    assert replicas["summary"]["world"] == 2 and replicas["summary"]["cases"] == 12
    assert replicas["summary"]["verdict"] == single["summary"]["verdict"] == "equivalent"
    same = ("key", "task", "depth", "ref_answer", "cp_answer", "tokens_identical", "max_logit_diff", "new_tokens")
    assert [{k: c[k] for k in same} for c in replicas["cases"]] == [{k: c[k] for k in same} for c in single["cases"]]


def test_needlebench_needle_lm_n3_real_scores(tmp_path):
    """The shipped model through the harness on 3 processes: equivalent to one process (tokens identical,
    logits within fp32 tolerance), and the scores are real retrieval, not 0 both ways."""
    out = tmp_path / "nb"
    args = ["-m", "hf_contextpar.eval", "needlebench", "--lengths", "1024", "--depths", "0,50,100"]
    args += ["--tasks", "single_retrieval", "--needles", "all", "--threads", "1", "--out", str(out)]
    procs = launch(3, args, timeout=600)
    _check(procs, 0)
    s = _report(out)["summary"]
    assert s["verdict"] == "equivalent" and s["world"] == 3 and s["cases"] == 24
    score = s["scores"]["single_retrieval"]
    assert score["reference"] == score["context_parallel"] >= 95, score  # shipped weights: 100 (24 of 24)


def test_several_needles_per_cell(tok, data):
    cases = nb.build_cases(data, tok, ["single_retrieval", "multi_retrieval"], [1024], [10, 90], needles=[1, 4])
    single = [p for p in cases if p.task == "single_retrieval"]
    assert [(p.depth, p.needle) for p in single] == [(10, 1), (10, 4), (90, 1), (90, 4)]
    for p in single:
        n = data.needles[p.needle]
        assert p.needles == ["\n" + n["needle"] + "\n"] and p.keywords == [n["arg2"]]
        assert p.question == n["retrieval_question"]
    assert [p.needle for p in cases if p.task == "multi_retrieval"] == [None, None]
    with pytest.raises(nb.DataError, match="out of range"):
        nb.build_cases(data, tok, ["single_retrieval"], [1024], [50], needles=[len(data.needles)])
    from hf_contextpar.eval.report import _cells

    rec = dict(task="t", length=1, depth=0, equivalent=True, tokens_identical=True, first_divergence=None)
    cells = _cells(
        [
            dict(rec, cp_score=100.0, ref_score=100.0, max_logit_diff=1e-6),
            dict(rec, cp_score=0.0, ref_score=0.0, max_logit_diff=2e-6, tokens_identical=False, first_divergence=3),
        ]
    )
    assert cells[("t", 1, 0)] == dict(
        cp_score=50.0, ref_score=50.0, equivalent=True, tokens_identical=False, first_divergence=3, max_logit_diff=2e-6
    )


def test_needlebench_broken_ring_is_not_equivalent(tmp_path):
    out = tmp_path / "broken"
    procs = launch(
        2,
        [
            WORKER,
            "needlebench",
            "--model",
            "tiny-llama",
            "--lengths",
            "1024",
            "--depths",
            "0,100",
            "--tasks",
            "single_retrieval",
            "--max-new-tokens",
            "4",
            "--strategy",
            "ring_pass_kv",
            "--out",
            str(out),
        ],
        timeout=300,
        env={"HF_CONTEXTPAR_TEST_BREAK_RING": "1"},
    )
    _check(procs, 1)
    assert "needlebench: NOT EQUIVALENT" in procs[0][1]
    s = _report(out)["summary"]
    assert s["verdict"] == "not equivalent" and s["equivalent_cases"] == 0 and s["worst_logit_diff"] > 1e-2


def test_bookcorpus_saved_reference_n2(tmp_path):
    from hf_contextpar.eval.cli import main

    ref = tmp_path / "ref.pt"
    args = ["bookcorpus", "--model", "tiny-llama", "--window", "700", "--num-windows", "3"]
    assert main(args + ["--save-reference", str(ref)]) == 0  # one process: this one
    out = tmp_path / "bc"
    procs = launch(2, ["-m", "hf_contextpar.eval", *args, "--reference", str(ref), "--out", str(out)], timeout=300)
    _check(procs, 0)
    rep = _report(out)
    assert rep["summary"]["verdict"] == "equivalent" and rep["summary"]["reference"].startswith(
        "saved single-process run"
    )
    assert [c["window"] for c in rep["cases"]] == [0, 1, 2]
    for c in rep["cases"]:
        assert c["tokens"] == 700 and c["argmax_agreement"] == 1.0 and c["max_logit_diff"] <= 1e-4
        assert c["max_nll_diff"] <= 1e-4 and c["ppl_ref"] == pytest.approx(c["ppl_cp"], rel=1e-5) and c["ppl_ref"] > 1


def test_clear_errors(tmp_path, capsys):
    from hf_contextpar.eval.cli import main

    (tmp_path / "report.json").write_text("{}")  # a previous run's: report.json must mean "this run completed"
    assert main(["needlebench", "--model", "tiny-llama", "--lengths", "70000", "--out", str(tmp_path)]) == 2
    assert "exceeds the model's context (max_position_embeddings = 65536)" in capsys.readouterr().err
    assert not (tmp_path / "report.json").exists()
    assert (
        main(
            [
                "bookcorpus",
                "--model",
                "tiny-llama",
                "--reference",
                str(tmp_path / "missing.pt"),
                "--window",
                "64",
                "--num-windows",
                "1",
                "--out",
                str(tmp_path),
            ]
        )
        == 2
    )
    assert "no such file" in capsys.readouterr().err
    assert (
        main(
            [
                "needlebench",
                "--model",
                "tiny-llama",
                "--data",
                str(tmp_path / "nowhere"),
                "--lengths",
                "1024",
                "--depths",
                "0",
                "--out",
                str(tmp_path),
            ]
        )
        == 2
    )
    assert "PaulGrahamEssays.jsonl not found under --data" in capsys.readouterr().err


def test_needlebench_files_through_datasets(tmp_path, tok):
    """The real-data path (NeedleBench's file layout, read with `datasets`) on a local copy: --data DIR."""
    essays = ["First essay. It has sentences! Does it? Yes. " * 40, "Second essay, shorter. " * 40]
    with open(tmp_path / "PaulGrahamEssays.jsonl", "w") as f:
        f.writelines(json.dumps(dict(text=t)) + "\n" for t in essays)
    needles = [
        dict(
            needle=f"Needle {i} says the code is {1000 + i}.",
            retrieval_question=f"What is code {i}? Please answer in the format 'The code is ______.'",
            arg1=f"code {i}",
            arg2=str(1000 + i),
            language=lang,
        )
        for i in range(4)
        for lang in ("English", "Chinese")
    ]
    with open(tmp_path / "needles.jsonl", "w") as f:
        f.writelines(json.dumps(n) + "\n" for n in needles)
    (tmp_path / "sub").mkdir()
    with open(tmp_path / "sub" / "multi_needle_reasoning_en.json", "w") as f:
        json.dump(
            [
                dict(
                    derivations=["A is B's parent.", "B lives in Qux."],
                    derivation_count=2,
                    question="Where does A's child live?",
                    answer="Qux",
                )
            ],
            f,
        )
    data, warning = nb.load_data("auto", str(tmp_path), builtin_model=True)
    assert warning is None and data.source.startswith(nb.HUB_REPO) and len(data.haystack) == 2
    assert all(n["language"] == "English" for n in data.needles) and len(data.needles) == 4
    cases = nb.build_cases(data, tok, list(nb.TASKS), [1200], [50])
    assert [p.task for p in cases] == list(nb.TASKS)
    for p in cases:
        assert 1200 - 24 <= len(p.ids) <= 1200 and all(k in "".join(p.needles).lower() for k in p.keywords)
    assert cases[2].keywords == ["qux"]


def test_bookcorpus_local_text_and_windows(tmp_path, tok):
    from hf_contextpar.eval import bookcorpus as bc

    (tmp_path / "books").mkdir()
    (tmp_path / "books" / "a.txt").write_text("the first sentence of a book .\n" * 100)
    ids, where, warning = bc.load_token_stream(tok, 2000, data=str(tmp_path / "books"))
    assert warning is None and where.startswith("local files") and len(ids) >= 2000
    assert tok.decode(ids[:31]) == "the first sentence of a book .\n"
    wins = bc.windows(ids, 500, 4, bos=256)
    assert [len(w) for w in wins] == [500] * 4 and all(w[0] == 256 for w in wins)
    assert sum((w[1:] for w in wins), []) == ids[: 4 * 499]  # consecutive, no token dropped or repeated
    with pytest.raises(nb.DataError, match="only"):
        bc.load_token_stream(tok, 10**6, data=str(tmp_path / "books"))


def test_generation_and_window_metrics():
    import torch
    from hf_contextpar.eval.compare import compare_generation, window_metrics

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 11, generator=g, dtype=torch.float64)
    tokens = logits.argmax(-1)
    same = compare_generation(tokens, logits, tokens.clone(), logits + 1e-7)
    assert (
        same["tokens_identical"] and same["first_divergence"] is None and same["max_logit_diff"] == pytest.approx(1e-7)
    )
    other = tokens.clone()
    other[2] = (tokens[2] + 1) % 11
    late = logits.clone()
    late[3:] += 5.0  # after the divergence the runs see different text: not compared
    d = compare_generation(tokens, logits, other, late)
    assert d["first_divergence"] == 2 and d["steps_compared"] == 3 and d["max_logit_diff"] == 0
    assert d["divergence_margin"] == pytest.approx(float(logits[2, tokens[2]] - logits[2, other[2]]))

    ids = torch.randint(0, 11, (40,), generator=g)
    ref = torch.randn(40, 11, generator=g, dtype=torch.float64)
    m = window_metrics(ref, ref + 0.5, ids, rows=7)  # a constant shift changes no probability
    assert m["max_logit_diff"] == pytest.approx(0.5) and m["max_nll_diff"] < 1e-12 and m["argmax_agreement"] == 1
    nll = torch.nn.functional.cross_entropy(ref[:-1], ids[1:])
    assert m["ppl_ref"] == pytest.approx(float(torch.exp(nll))) == pytest.approx(m["ppl_cp"])
    flipped = ref.clone()
    flipped[::2] *= -1
    assert window_metrics(ref, flipped, ids, rows=16)["argmax_agreement"] < 0.75


def test_low_precision_tolerance_is_the_kernel_swap():
    import torch
    from hf_contextpar.eval.oracle import kernel_swap, tolerance

    from hf_contextpar.models import tiny_model

    model = tiny_model("llama", dtype=torch.bfloat16)
    ids = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(1))
    swap = kernel_swap(model, ids)
    assert swap is not None and swap > 0 and model.config._attn_implementation == "sdpa"
    assert tolerance(torch.bfloat16, "llama", swap)[0] == max(swap, 1e-2)
    assert tolerance(torch.bfloat16, "llama", 1e-4)[0] == 1e-2  # the floor
    assert tolerance(torch.float32)[0] == 1e-4 and tolerance(torch.float64)[0] == 1e-10
    assert tolerance(torch.float64, "gemma2")[0] == 1e-5


def test_csa_report_beside_the_exact_run_n2(tmp_path):
    """`eval csa`: NeedleBench cells and a BookCorpus window under the exact run, CSA and one process; the exact
    run is the one process's, CSA its reference's, and the dropping saves bytes against keep-all CSA. With
    --exact-strategies all, every exact prefill strategy's prefill per rank beside CSA's, the fastest named."""
    from hf_contextpar.eval.csa_strategies import CSA_EVEN

    from hf_contextpar.plan.strategies import prefill_names

    out = tmp_path / "csa"
    args = ["-m", "hf_contextpar.eval", "csa", "--csa", "0.5", "--lengths", "768", "--depths", "50"]
    args += ["--exact-strategies", "all"]
    procs = launch(2, [*args, "--num-windows", "1", "--window", "512", "--max-new-tokens", "8", "--out", str(out)])
    _check(procs, 0)
    rep = json.load(open(out / "report.json"))
    s = rep["summary"]
    assert s["exact_equivalent"] and s["csa_matches_reference"] and s["world"] == 2
    assert s["csa"] == "CSA(topology=1x2, keep L2=0.5, observe=64)"
    assert s["bytes_csa"] < s["bytes_keep_all"] and s["ppl_csa"] is not None
    assert [r["key"] for r in rep["records"]] == ["single_retrieval/768/50", "multi_retrieval/768/50", "window/0"]
    assert "| window/0 |" in (out / "report.md").read_text()
    st = s["strategies"]
    ran = set(st["prefill_s_per_rank"])
    assert ran | set(st["skipped_strategies"]) == {*prefill_names(), "exact run (auto)", "csa", CSA_EVEN}
    assert all(len(t) == 2 and all(x > 0 for x in t) for t in st["prefill_s_per_rank"].values())
    assert st["fastest_exact"] in ran - {"csa", CSA_EVEN} and st["csa_over_fastest_exact"] > 0
    # CSA's balanced partitions (the default), which its reference cut too: front-loaded
    cuts = [r["csa_partitions"] for r in rep["records"]]
    assert all(len(c) == 2 and c[0] >= c[1] > 0 for c in cuts) and sum(cuts[2]) < sum(cuts[0]), cuts
    assert set(st["prefill_s_slowest_by_length"]) == {"768", "window (512)"}
    assert "## Prefill per rank: CSA beside every exact strategy" in (out / "report.md").read_text()


def test_csa_config_writes_settings_the_mode_loads(tmp_path):
    """`eval csa-config` on the calibration split: a curve from keep-all down, the chosen settings in a file
    that `CSA.load` (and `--csa FILE`) reads back."""
    from hf_contextpar.sparse import CSA

    out = tmp_path / "cfg"
    args = ["-m", "hf_contextpar.eval", "csa-config", "--lengths", "512", "--depths", "50", "--grid", "1.0,0.5"]
    extra = ["--tasks", "single_retrieval", "--max-new-tokens", "8", "--window", "512", "--out", str(out)]
    procs = launch(2, [*args, *extra])
    _check(procs, 0)
    saved = json.load(open(out / "csa_settings.json"))
    assert all(p["ppl_increase_pct"] is not None for p in saved["curve"]) and saved["max_ppl_increase"] == 1.0
    assert all(p["ppl_increase_pct"] <= 1.0 for p in saved["curve"] if p["keep"] >= saved["keep"])
    assert [p["keep"] for p in saved["curve"]][:1] == [1.0] and saved["keep"] in (1.0, 0.5)
    assert all(p["drop"] <= 0 for p in saved["curve"] if p["keep"] >= saved["keep"])
    assert CSA.load(str(out / "csa_settings.json")).keep == saved["keep"]
    assert "keep (level 2) | score | drop | ppl +%" in procs[0][1]
