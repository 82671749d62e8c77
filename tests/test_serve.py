"""The server (issue 60), started as a user starts it (`torchrun ... -m hf_contextpar serve`, a real launcher
in a subprocess) and driven by real clients on loopback (the `openai` package and raw HTTP), against the
unpatched built-in model on one process in this test's own process: greedy answers token-identical, seeded
sampling identical to one process with that seed, a second chat turn over the kept sharded KV (cached tokens
reported, exact), every bad input a 4xx with the ranks still in step, concurrent clients, a dropped stream,
the API key, and SIGINT to the launcher ending every process.

One server per N (module-scoped): N = 2 every run, N = 3 on the rotation's days."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_contextpar.models import builtin_model_path

sys.path.insert(0, os.path.dirname(__file__))
from launch import free_port  # noqa: E402

openai = pytest.importorskip("openai")
MODEL = builtin_model_path("needle-lm")
DOC = (
    "The harbour master of Tolvik Bay keeps the spare oars inside a green barrel. "
    + "Ships come and go in the grey morning, and the gulls cry over the water. " * 12
)
QUESTION = (
    "Where does the harbour master keep the spare oars? Please answer in the format 'The spare oars are inside ______.'"
)


@pytest.fixture(scope="module")
def reference():
    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype="auto").eval()

    def generate(ids: list[int], max_new_tokens: int, seed: int | None = None, **sampling) -> list[int]:
        if seed is not None:
            torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, **sampling)
        return out[0, len(ids) :].tolist()

    return tok, generate


class Server:
    """`torchrun --nproc_per_node n -m hf_contextpar serve --port 0 ...` in a subprocess; its URL from its banner."""

    def __init__(self, n: int, *extra: str):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        port = str(free_port())
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_port", port]
        cmd += ["-m", "hf_contextpar", "serve", "--port", "0", "--timeout", "30", *extra]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        ready = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.lines.append(line)
                if "serving " in line:
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(120):
            self.stop()
            raise AssertionError("the server did not start:\n" + "".join(self.lines[-40:]))
        self.url = re.search(r"(http://\S+/v1)", next(x for x in self.lines if "serving " in x))[1]
        self.client = openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=120)

    def post(self, path: str, body, headers=None) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url[:-3] + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired as e:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(
                    "the server did not exit within 60 s of SIGINT:\n" + "".join(self.lines[-40:])
                ) from e
        return self.proc.returncode


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"N{n}")
def server(request):
    s = Server(request.param)
    yield s
    s.stop()


def _chat_ids(tok, messages) -> list[int]:
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]


def test_completions_exact(server, reference):
    tok, generate = reference
    prompt = DOC + "\n\nNow, the question is: " + QUESTION + "\n"
    ids = tok(prompt).input_ids
    want = generate(ids, 12)
    got = server.client.completions.create(model="needle-lm", prompt=prompt, max_tokens=12)
    assert tok(got.choices[0].text, add_special_tokens=False).input_ids == [t for t in want if t != tok.eos_token_id]
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == len(want)
    by_ids = server.client.completions.create(model="needle-lm", prompt=ids, max_tokens=12)  # token ids, as lm-eval
    assert by_ids.choices[0].text == got.choices[0].text
    streamed = server.client.completions.create(model="needle-lm", prompt=prompt, max_tokens=12, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == got.choices[0].text


def test_chat_exact_and_the_second_turn_reuses_the_kept_cache(server, reference):
    tok, generate = reference
    messages = [{"role": "user", "content": DOC}, {"role": "user", "content": QUESTION}]
    ids = _chat_ids(tok, messages)
    first = server.client.chat.completions.create(model="needle-lm", messages=messages, max_tokens=16)
    answer = first.choices[0].message.content
    assert answer == tok.decode(generate(ids, 16), skip_special_tokens=True)
    assert "green barrel" in answer  # needle-lm finds this one
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "What is the pass key?"}]
    ids2 = _chat_ids(tok, messages)
    second = server.client.chat.completions.create(model="needle-lm", messages=messages, max_tokens=10)
    assert second.choices[0].message.content == tok.decode(generate(ids2, 10), skip_special_tokens=True)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert len(ids) < cached < len(ids2), (cached, len(ids), len(ids2))  # the first turn's prompt and answer
    streamed = server.client.chat.completions.create(model="needle-lm", messages=messages, max_tokens=10, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == second.choices[0].message.content


def test_seeded_sampling_is_one_process_with_that_seed(server, reference):
    tok, generate = reference
    prompt = DOC[:300]
    ids = tok(prompt).input_ids
    want = generate(ids, 12, seed=1234, do_sample=True, temperature=0.9)
    got = server.client.completions.create(model="needle-lm", prompt=prompt, max_tokens=12, seed=1234, temperature=0.9)
    assert got.choices[0].text == tok.decode(want, skip_special_tokens=True)


BAD = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "7"}, 400, "max_tokens"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 3}, 400, "one prompt"),
    ("/v1/completions", {"prompt": [5, 99999], "max_tokens": 3}, 400, "token id"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 40000}, 400, "positions"),
    ("/v1/completions", {"prompt": "hi", "n": 3}, 400, "'n'"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1}, 400, "not supported"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "needle-lm"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "stream"),
    ("/v1/completions", b"{not json", 400, "JSON"),
]


def test_bad_input_is_a_4xx_and_the_ranks_stay_in_step(server, reference):
    tok, generate = reference
    for path, body, status, words in BAD:
        code, answer = server.post(path, body)
        assert code == status and words in answer["error"]["message"], (path, body, code, answer)
    ids = tok(DOC[:200]).input_ids
    got = server.client.completions.create(model="needle-lm", prompt=ids, max_tokens=6)
    assert got.choices[0].text == tok.decode(generate(ids, 6), skip_special_tokens=True)


def test_concurrent_clients_and_a_dropped_stream(server, reference):
    tok, generate = reference
    prompts = [DOC[: 150 + 40 * i] for i in range(6)]
    answers = [None] * 6

    def ask(i):
        answers[i] = (
            server.client.completions.create(model="needle-lm", prompt=prompts[i], max_tokens=8).choices[0].text
        )

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for i, p in enumerate(prompts):
        assert answers[i] == tok.decode(generate(tok(p).input_ids, 8), skip_special_tokens=True), i
    stream = server.client.completions.create(model="needle-lm", prompt=DOC, max_tokens=400, stream=True)
    next(iter(stream))
    stream.close()  # the client goes away mid-stream: every rank stops at the same step
    ids = tok(DOC[:250]).input_ids
    got = server.client.completions.create(model="needle-lm", prompt=ids, max_tokens=6)
    assert got.choices[0].text == tok.decode(generate(ids, 6), skip_special_tokens=True)
    assert server.post("/health", b"")[0] in (200, 405)


def test_api_key_and_sigint():
    s = Server(2, "--api-key", "sesame")
    try:
        code, body = s.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert code == 401 and "API key" in body["error"]["message"]
        code, body = s.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}, {"Authorization": "Bearer sesame"})
        assert code == 200 and body["usage"]["completion_tokens"] == 2
    finally:
        rc = s.stop()
    # every rank stopped in step; torchrun itself re-raises the SIGINT it got (exit status 1 after its workers' 0)
    out = "".join(s.lines)
    assert "stopped: every rank left in step" in out and "Root Cause" not in out and rc in (0, 1), out[-3000:]
