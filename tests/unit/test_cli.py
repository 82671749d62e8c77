"""The README's main job: `torchrun --nproc_per_node 2 -m hf_contextpar generate` (needle-lm, a needle prompt).

This file holds the checks that run in the pytest process; the others, and the feature's whole description, are in
tests/multi_process/test_cli.py.
"""

from __future__ import annotations

import os

from areas import ROOT  # the repository root

# -- bad arguments: refused while parsing (exit 2, the flag named), before a model or a process group ----------------
BAD_ARGUMENTS = [
    (["generate", "--depth", "-10"], "--depth: must be 0..100"),
    (["generate", "--depth", "150"], "--depth: must be 0..100"),
    (["generate", "--prompt-tokens", "-5"], "--prompt-tokens: must be at least 1"),
    (["generate", "--max-new-tokens", "0"], "--max-new-tokens: must be at least 1"),
    (["generate", "--threads", "-1"], "--threads: must be 0 or more"),
    (["generate", "--decode", "ring_pass_q"], "invalid choice"),  # one sequence: batched decode never applies
    (["calibrate", "--tokens", "0"], "--tokens: must be at least 1"),
    (["calibrate", "--out", "README.md/cal.json"], "cannot write"),
    (["sweep", "--miss-rates", "0.5,x"], "--miss-rates: expected numbers"),
    (["sweep", "--miss-rates", "0,1"], "--miss-rates: each value must be in (0, 1]"),
    (["kvr-table", "--lengths", "512,abc"], "--lengths: expected an integer"),
    (["predict", "--world", "-2"], "--world: must be at least 1"),
    (["predict", "--world", "a,b"], "--world: expected an integer"),
    (["predict", "--tp", "0"], "--tp: must be at least 1"),
    (["predict", "--lengths", "0"], "--lengths: must be at least 1"),
    (["predict", "--miss-rates", "2"], "--miss-rates: each value must be in (0, 1]"),
]


def test_bad_arguments_are_refused_while_parsing(capsys):
    from hf_contextpar.tools.cli import main

    cwd = os.getcwd()
    os.chdir(ROOT)  # README.md/cal.json: a folder that is a file
    try:
        for argv, needle in BAD_ARGUMENTS:
            try:
                main(argv)
            except SystemExit as e:
                err = capsys.readouterr().err
                assert e.code == 2 and needle in err, (argv, e.code, err[-500:])
            else:
                raise AssertionError(f"{argv} was accepted")
    finally:
        os.chdir(cwd)


def test_predict_refuses_a_file_that_is_not_a_calibration(tmp_path):
    from hf_contextpar.tools.cli import main

    for text in ("not json", '{"attn_flops": 0.0, "bandwidth": 1e9}'):  # the second: what `calibrate --tokens 0` saved
        path = tmp_path / "cal.json"
        path.write_text(text)
        try:
            main(["predict", "--model", "tiny-llama", "--hardware", str(path), "--world", "2", "--lengths", "1024"])
        except SystemExit as e:
            assert isinstance(e.code, str) and "not a usable calibration JSON" in e.code, e.code
        else:
            raise AssertionError(f"{text!r} was accepted as a calibration")
