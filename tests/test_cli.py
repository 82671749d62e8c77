"""The README's main job: `torchrun --nproc_per_node 2 -m hf_contextpar generate` (needle-lm, a needle prompt)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from launch import free_port, python  # noqa: E402


def test_cli_generate_under_torchrun():
    """The README's main job on 2 processes: the needle's answer, identical to the unpatched single process."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        f"--master_port={free_port()}",
        "-m",
        "hf_contextpar",
        "generate",
    ]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    why = f"rc {res.returncode}\nstdout:\n{res.stdout[-2000:]}\nstderr:\n{res.stderr[-3000:]}"
    assert res.returncode == 0, why
    assert "question: What number does the lighthouse keeper of Velmora Point paint" in res.stdout, why
    assert "answer:   The number is 7341." in res.stdout and "expected: '7341' -> correct" in res.stdout, why
    assert re.search(r"processes 2  prompt 40[6-9]\d tokens", res.stdout), why  # the longest prompt of <= 4096 tokens
    new = int(re.search(r"new (\d+) tokens", res.stdout).group(1))
    prompt = int(re.search(r"prompt (\d+) tokens", res.stdout).group(1))
    cached = [int(m) for m in re.findall(r"rank \d: KV cache (\d+) tokens/layer", res.stdout)]
    assert len(cached) == 2 and sum(cached) == prompt + new - 1 and max(cached) - min(cached) <= 1, why
    assert "tokens identical: True" in res.stdout, why


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
    os.chdir(os.path.join(os.path.dirname(__file__), ".."))  # README.md/cal.json: a folder that is a file
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


def test_eval_gate_does_not_pass_on_an_earlier_report(tmp_path):
    """A harness run that fails before writing its report leaves no earlier report to pass on."""
    for kind in ("needlebench", "bookcorpus"):  # an earlier run's verdicts
        os.makedirs(tmp_path / kind)
        (tmp_path / kind / "report.json").write_text('{"summary": {"verdict": "equivalent"}}')
    gate = os.path.join(os.path.dirname(__file__), "..", "examples", "eval_gate.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    res = python([gate, "--lengths", "512,x", "--dtype", "int8", "--out", str(tmp_path)], env=env, timeout=300)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert "needlebench: could not run" in res.stdout and "bookcorpus: could not run" in res.stdout, res.stdout


def test_eval_drops_an_earlier_report_before_anything_can_fail(tmp_path):
    (tmp_path / "report.json").write_text('{"summary": {"verdict": "equivalent"}}')
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    cmd = ["-m", "hf_contextpar.eval", "needlebench", "--lengths", "512,x", "--out", str(tmp_path)]
    res = python(cmd, env=env, timeout=300)
    assert res.returncode == 2 and "--lengths takes comma-separated integers" in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "report.json").exists()
