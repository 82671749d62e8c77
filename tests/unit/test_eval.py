"""The exactness harness (`python -m hf_contextpar.eval`): prompt construction, and end to end on
the built-in model, offline, N=2 (CPU, gloo): it says "equivalent" for the real engine and
"not equivalent" (exit 1) for an engine with one ring step dropped.

This file holds the checks that run in the pytest process; the ones that launch ranks are in tests/multi_process/test_eval.py.
"""

from __future__ import annotations

import json
import re

import pytest
from hf_contextpar.eval import needlebench as nb

from hf_contextpar.models import byte_tokenizer

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
