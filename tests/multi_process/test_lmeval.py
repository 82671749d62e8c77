"""`hf_contextpar lm_eval` (issue 31): lm-eval's `hf-cp` model on 2 and 3 processes gives one process's
lm-eval results for the unpatched model (`lm_eval --model hf`) on a local task (tests/lmeval_task:
needle questions scored by loglikelihood and by generation, rolling loglikelihood over four
documents): the same requests on every rank (no sharding), counted metrics and generations identical,
per-sample loglikelihoods and the metrics made of them within fp32 rounding (the exactness oracle's
logit tolerance, twice per scored token: a log-softmax moves by at most twice its logits' error), and
only global rank 0 writing results or samples, also where every rank is a node's local rank 0.

This file holds the checks that launch ranks (tests/launch.py); the in-process ones are in tests/unit/test_lmeval.py.
"""

from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys

import pytest
from areas import ROOT  # the repository root
from hf_contextpar.eval.oracle import logit_tolerance
from launch import free_port, torchrun
from serving import Server
from transformers import AutoTokenizer

TASK_DIR = os.path.join(ROOT, "tests", "lmeval_task")
MODEL = os.path.join(ROOT, "hf_contextpar", "assets", "needle-lm")
TASKS = {"cp_needle_mc": 20, "cp_needle_gen": 20, "cp_rolling": 4}  # task -> documents
COUNTED = ("acc", "acc_norm", "keyword")  # metrics that count answers: equal
ENV = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")


def lm_eval_args(model: str, out) -> list[str]:
    return [
        *("--model", model, "--model_args", f"pretrained={MODEL},dtype=float32", "--device", "cpu"),
        *("--tasks", ",".join(TASKS), "--include_path", TASK_DIR, "--log_samples", "--output_path", str(out)),
    ]


def run(cmd: list[str], env=ENV, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *cmd], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def written(out) -> tuple[dict, dict]:
    """(results, {task: samples by doc_id}) of the one run written under `out`."""
    results = glob.glob(os.path.join(str(out), "*", "results_*.json"))
    assert len(results) == 1, f"expected one results file under {out}, found {results}"
    samples = {}
    for task in TASKS:
        (path,) = glob.glob(os.path.join(os.path.dirname(results[0]), f"samples_{task}_*.jsonl"))
        with open(path) as f:
            samples[task] = sorted((json.loads(line) for line in f), key=lambda s: s["doc_id"])
    with open(results[0]) as f:
        return json.load(f), samples


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """lm-eval's own `hf` model, unpatched, one process."""
    out = tmp_path_factory.mktemp("reference")
    done = run(["-m", "lm_eval", *lm_eval_args("hf", out)])
    assert done.returncode == 0, done.stderr[-4000:]
    return written(out)


def _tokens(tok, text: str) -> int:
    return len(tok(text, add_special_tokens=False).input_ids)


def assert_same_evaluation(got, want):
    """Metrics and samples of a context-parallel run against the one-process reference (module docstring)."""
    (results, samples), (ref_results, ref_samples) = got, want
    tok = AutoTokenizer.from_pretrained(MODEL)
    per_token = 2 * logit_tolerance("qwen2", "float32")
    for task, docs in TASKS.items():
        mine, ref = samples[task], ref_samples[task]
        assert len(mine) == len(ref) == docs, f"{task}: {len(mine)} samples, reference {len(ref)}, task {docs}"
        bound = {}  # doc_id -> the loglikelihood slack of its requests, summed
        for s, r in zip(mine, ref):
            assert (s["doc_id"], s["prompt_hash"], s["arguments"]) == (r["doc_id"], r["prompt_hash"], r["arguments"])
            if task == "cp_needle_gen":
                assert s["resps"] == r["resps"], f"{task} doc {s['doc_id']}: generated {s['resps']} vs {r['resps']}"
                continue
            slack = 0.0
            requests = [s["arguments"][f"gen_args_{i}"] for i in range(len(s["arguments"]))]
            for args, got_resp, want_resp in zip(requests, s["resps"], r["resps"], strict=True):
                # one repeat per request: multiple choice [loglikelihood, is_greedy], rolling loglikelihood
                scored = args["arg_1"] if task == "cp_needle_mc" else args["arg_0"]
                limit = per_token * _tokens(tok, scored)
                got_ll, want_ll = (
                    float(x[0][0]) if task == "cp_needle_mc" else float(x[0]) for x in (got_resp, want_resp)
                )
                diff = abs(got_ll - want_ll)
                assert diff <= limit, f"{task} doc {s['doc_id']}: loglikelihood differs by {diff:.3g} > {limit:.3g}"
                slack += limit
            bound[s["doc_id"]] = slack
            for metric in COUNTED:
                assert s.get(metric) == r.get(metric), f"{task} doc {s['doc_id']}: {metric} {s.get(metric)}"
        got_metrics, want_metrics = results["results"][task], ref_results["results"][task]
        for key, want_value in want_metrics.items():
            metric = key.split(",")[0]
            if metric.endswith("_stderr"):
                continue
            value = got_metrics[key]
            if metric in COUNTED or key in ("name", "alias", "sample_len"):
                assert value == want_value, f"{task} {key}: {value} vs {want_value}"
                continue
            # rolling metrics: exp or a multiple of -sum(loglikelihood) / sum(units), units from the samples
            units = sum(s[metric][1] for s in ref)
            slack = sum(bound.values()) / units
            diff = abs(math.log(value) - math.log(want_value)) if "perplexity" in metric else abs(value - want_value)
            limit = slack if "perplexity" in metric else slack / math.log(2)
            assert diff <= limit + 1e-12, f"{task} {key}: {value} vs {want_value} (allowed {limit:.3g})"
        assert got_metrics.keys() == want_metrics.keys(), task


def test_three_processes_under_torchrun(reference, tmp_path):
    """The README's command on 3 processes: one results file and one table, the reference's evaluation."""
    done = torchrun(3, ["-m", "hf_contextpar", "lm_eval", *lm_eval_args("hf-cp", tmp_path)], timeout=900, env=ENV)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("|Version|Filter|") == 1, done.stdout[-3000:]
    got = written(tmp_path)
    assert got[0]["config"]["context_parallel_processes"] == 3
    assert_same_evaluation(got, reference)


def test_local_completions_through_the_server(reference, tmp_path):
    """lm-eval's own OpenAI client (`local-completions`: token ids, `echo` + `logprobs` for loglikelihoods,
    generation with stop sequences; the server's tokenizer through /tokenize and /tokenizer_info) against
    `hf_contextpar serve` on 2 processes: the reference's evaluation."""
    server = Server(2, MODEL, "--served-name", "needle-lm")
    try:
        url = server.url + "/completions"
        args = f"model=needle-lm,base_url={url},num_concurrent=1,max_retries=1,tokenized_requests=True"
        cmd = ["-m", "lm_eval", "--model", "local-completions", "--model_args", args, "--tasks", ",".join(TASKS)]
        done = run([*cmd, "--include_path", TASK_DIR, "--log_samples", "--output_path", str(tmp_path)])
        assert done.returncode == 0, done.stderr[-4000:]
        assert "Auto-detected remote tokenizer support" in done.stderr + done.stdout
    finally:
        server.stop()
    assert_same_evaluation(written(tmp_path), reference)


def test_two_nodes_only_global_rank_zero_writes(reference, tmp_path):
    """2 processes, each the local rank 0 of its node (what lm-eval checks before writing), each with its
    own --output_path: rank 0 writes the reference's evaluation, rank 1 writes and prints nothing."""
    port, procs = free_port(), []
    for rank in range(2):
        env = dict(ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
        env.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank))
        cmd = ["-m", "hf_contextpar", "lm_eval", *lm_eval_args("hf-cp", tmp_path / f"rank{rank}")]
        procs.append(
            subprocess.Popen(
                [sys.executable, *cmd], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outs = [p.communicate(timeout=900) for p in procs]
    for rank, (p, (_, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank}:\n{err[-4000:]}"
    assert "|Version|Filter|" in outs[0][0] and "|Version|Filter|" not in outs[1][0], outs[1][0][-2000:]
    assert not os.path.exists(tmp_path / "rank1"), os.listdir(tmp_path / "rank1")
    got = written(tmp_path / "rank0")
    assert got[0]["config"]["context_parallel_processes"] == 2
    assert_same_evaluation(got, reference)


def test_other_models_are_refused(tmp_path):
    """`hf_contextpar lm_eval --model hf` would be lm-eval's data parallelism: refused with the reason."""
    done = run(["-m", "hf_contextpar", "lm_eval", *lm_eval_args("hf", tmp_path)], timeout=300)
    assert done.returncode != 0 and "data parallelism" in done.stderr, done.stderr[-2000:]
    assert not os.listdir(tmp_path)


def test_tensor_parallel_inside_context_parallel(reference, tmp_path):
    """`tp=2` on 4 processes: TP 2 x CP 2 through mesh.py's loader (weights read sharded), the
    reference's evaluation (TP's all-reduces only reorder fp32 sums: within the same bounds)."""
    args = lm_eval_args("hf-cp", tmp_path)
    args[args.index("--model_args") + 1] += ",tp=2"
    done = torchrun(4, ["-m", "hf_contextpar", "lm_eval", *args], timeout=900, env=ENV)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("|Version|Filter|") == 1, done.stdout[-3000:]
    got = written(tmp_path)
    assert got[0]["config"]["context_parallel_processes"] == 2  # the CP group: 4 ranks / tp 2
    assert_same_evaluation(got, reference)


def test_replicas_of_context_parallel_groups_through_accelerate(reference, tmp_path):
    """2 replicas x CP 2 on 4 processes, the layout from accelerate's PARALLELISM_CONFIG_* environment under
    `accelerate launch --multi_gpu`: lm-eval shards the requests over the replicas, each request is evaluated by
    exactly one (the run says so), and the one results file is the reference's evaluation."""
    env = dict(ENV, PARALLELISM_CONFIG_DP_REPLICATE_SIZE="2", PARALLELISM_CONFIG_CP_SIZE="2")
    launcher = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "4"]
    launcher += ["--main_process_port", str(free_port())]
    done = run([*launcher, "-m", "hf_contextpar", "lm_eval", *lm_eval_args("hf-cp", tmp_path)], env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("|Version|Filter|") == 1, done.stdout[-3000:]
    (said,) = [line for line in done.stdout.splitlines() if "replicas of CP 2 evaluated" in line]
    shares = said.split("evaluated ")[1].split(" =")[0].split(" + ")
    assert (
        len(shares) == 2 and all(int(n) > 0 for n in shares) and said.endswith("0 evaluated by more than one replica")
    )
    got = written(tmp_path)
    assert got[0]["config"]["context_parallel_processes"] == 2
    assert_same_evaluation(got, reference)


def test_replicas_of_tensor_and_context_parallel_groups(reference, tmp_path):
    """`cp_size=2,tp=2` on 8 processes: 2 replicas of CP 2 x TP 2 (TP groups of consecutive ranks, loaded by
    the (cp, tp) mesh; each replica's CP group one rank of each of its TP groups), the reference's evaluation."""
    args = lm_eval_args("hf-cp", tmp_path)
    args[args.index("--model_args") + 1] += ",cp_size=2,tp=2"
    done = torchrun(8, ["-m", "hf_contextpar", "lm_eval", *args], timeout=1200, env=ENV)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "0 evaluated by more than one replica" in done.stdout, done.stdout[-3000:]
    got = written(tmp_path)
    assert got[0]["config"]["context_parallel_processes"] == 2
    assert_same_evaluation(got, reference)


def test_use_cache_is_refused(tmp_path):
    """lm-eval's --use_cache keeps one response database per local rank: a rank finding a response there
    would skip a forward its peers run. Refused before any model loads, nothing written."""
    cache = tmp_path / "cache"
    done = run(["-m", "hf_contextpar", "lm_eval", *lm_eval_args("hf-cp", tmp_path / "out"), "--use_cache", str(cache)])
    assert done.returncode != 0 and "--use_cache" in done.stderr and "skip" in done.stderr, done.stderr[-2000:]
    assert not os.path.exists(tmp_path / "out") and not glob.glob(str(cache) + "*")
