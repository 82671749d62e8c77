"""`hf_contextpar lm_eval` (issue 31): lm-eval's `hf-cp` model on 2 and 3 processes gives one process's
lm-eval results for the unpatched model (`lm_eval --model hf`) on a local task (tests/lmeval_task:
needle questions scored by loglikelihood and by generation, rolling loglikelihood over four
documents): the same requests on every rank (no sharding), counted metrics and generations identical,
per-sample loglikelihoods and the metrics made of them within fp32 rounding (the exactness oracle's
logit tolerance, twice per scored token: a log-softmax moves by at most twice its logits' error), and
only global rank 0 writing results or samples, also where every rank is a node's local rank 0.

This file holds the checks that run in the pytest process; the others, and the feature's whole description, are in
tests/multi_process/test_lmeval.py.
"""

from __future__ import annotations

import os
import sys

import pytest
from areas import ROOT  # the repository root

MODEL = os.path.join(ROOT, "hf_contextpar", "assets", "needle-lm")


def test_refusals_read_the_command_line_and_leave_a_config_file_to_lm_eval(tmp_path, monkeypatch):
    """The early refusal reads what the command line names; a model named in a --config file (no --model) is not
    refused there: it reaches lm-eval, whose simple_evaluate (wrapped) checks the model it resolved."""
    import lm_eval.evaluator
    from lm_eval._cli.harness import HarnessCLI

    from hf_contextpar.tools import lmeval

    monkeypatch.setattr(lm_eval.evaluator, "simple_evaluate", lm_eval.evaluator.simple_evaluate)  # main wraps it
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    ran = []
    monkeypatch.setattr(HarnessCLI, "execute", lambda self, args: ran.append(args))
    config = tmp_path / "run.yaml"
    config.write_text(f"model: hf-cp\nmodel_args: pretrained={MODEL}\n")
    lmeval.main(["--config", str(config), "--tasks", "cp_needle_mc"])
    assert len(ran) == 1 and ran[0].model is None
    for extra, needle in [(["--model", "hf"], "data parallelism"), (["-M", "hf-cp", "-c", "x"], "--use_cache")]:
        with pytest.raises(SystemExit, match=needle):
            lmeval.main([*extra, "--tasks", "cp_needle_mc"])
    assert len(ran) == 1


def test_csa_model_args_parse_on_one_process(tmp_path):
    """hf-cp's csa / topology / observe (issue 41): parsed before the model loads, as --csa is elsewhere; per-level
    fractions joined by ':' (lm-eval cuts --model_args at commas); topology alone, or a bad value, is refused."""
    from hf_contextpar.sparse import CSA
    from hf_contextpar.tools.lmeval import approximate_note, csa_model_args

    assert csa_model_args() is None and csa_model_args(csa="", topology="") is None
    assert csa_model_args(csa="0.6", topology="2x2") == CSA(keep=0.6, topology="2x2")
    assert csa_model_args(csa=0.6, observe="16") == CSA(keep=0.6, observe=16)  # lm-eval may pass numbers
    assert csa_model_args(csa="0.9:0.5", topology="2x2").keep == (0.9, 0.5)
    path = CSA(keep=(0.6, 0.3), topology="2x2").save(str(tmp_path / "csa_settings.json"))
    assert csa_model_args(csa=path) == CSA(keep=(0.6, 0.3), topology="2x2")
    for kwargs, needle in [
        (dict(topology="2x2"), "add csa=KEEP"),
        (dict(csa="most"), "keep fractions"),
        (dict(csa="0.6", observe="x"), "observe"),
        (dict(csa="0.6", observe="0"), "observe"),
        (dict(csa="0.3:0.6"), "not grow"),
        (dict(csa="0.6", topology="2by2"), "'2x2'"),
    ]:
        with pytest.raises(ValueError, match=needle):
            csa_model_args(**kwargs)
    assert "APPROXIMATE" in approximate_note(CSA(keep=0.6, topology="2x2").resolved(4).describe())
