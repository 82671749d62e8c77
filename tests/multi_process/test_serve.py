"""The server (issue 60), started as a user starts it (`torchrun ... -m hf_contextpar serve`, a real launcher
in a subprocess) and driven by real clients on loopback (the `openai` package and raw HTTP), against the
unpatched built-in model on one process in this test's own process: greedy answers token-identical, seeded
sampling identical to one process with that seed, a second chat turn over the kept sharded KV (cached tokens
reported, exact), every bad input a 4xx with the ranks still in step, concurrent clients, a dropped stream,
the API key, and SIGINT to the launcher ending every process.

One server per N (module-scoped): N = 2 every run, N = 3 on the rotation's days."""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest
import torch
from serving import Server
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_contextpar.models import builtin_model_path

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


def test_echo_and_logprobs_are_one_process_log_softmax(server, reference):
    """lm-eval's loglikelihood request (token ids, echo, logprobs=1, max_tokens=1) with 2 alternatives: the prompt
    echoed, each token's log-probability that of one process's forward (within twice fp32's logit tolerance),
    the alternatives its top ones."""
    tok, generate = reference
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype="auto").eval()
    ids = tok(DOC[:400]).input_ids
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    got = server.client.completions.create(
        model="needle-lm", prompt=ids, max_tokens=1, echo=True, logprobs=2, temperature=0
    ).choices[0]
    assert got.text.startswith(tok.decode(ids)) and got.logprobs.token_logprobs[0] is None
    new = generate(ids, 1)[0]
    lps = got.logprobs.token_logprobs[1:]
    assert len(lps) == len(ids)
    expected = [float(want[i, t]) for i, t in enumerate(ids[1:] + [new])]
    assert max(abs(a - b) for a, b in zip(lps, expected)) <= 2e-4
    for row, top in zip(want, got.logprobs.top_logprobs[1:]):
        assert sorted(top.values(), reverse=True) == pytest.approx(row.topk(2).values.tolist(), abs=2e-4)


def test_a_client_gone_during_a_long_prefill_stops_it_at_a_layer(server, reference):
    """A request of 30K tokens (seconds of prefill here) whose client hangs up after half a second, streamed and
    not (a non-streamed request's connection is watched while it runs): every rank stops before the same decoder
    layer (the server says which), and the next request is answered, exact."""
    tok, generate = reference
    ids = tok(DOC * 80).input_ids[:30000]
    host, port = server.url.split("//")[1].split("/")[0].split(":")
    for stream in (True, False):
        before = len(server.lines)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({"prompt": ids, "max_tokens": 4, "stream": stream}),
            {"Content-Type": "application/json"},
        )
        time.sleep(0.5)
        conn.close()
        deadline = time.time() + 60

        def said():
            return [line for line in server.lines[before:] if line.startswith("request cancelled")]

        while not said() and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # and nothing more: one line, from rank 0
        assert not any("Traceback" in line for line in server.lines[before:]), server.lines[before:]
        (line,) = said()
        assert "prefill stopped before layer" in line and int(line.split("layer")[-1]) < 6, (
            stream,
            line,
        )  # needle-lm's 6 layers: it stopped inside the prefill
    short = tok(DOC[:200]).input_ids
    got = server.client.completions.create(model="needle-lm", prompt=short, max_tokens=6)
    assert got.choices[0].text == tok.decode(generate(short, 6), skip_special_tokens=True)


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
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1, "stream": True}, 400, "without 'stream'"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 1.0}, 400, "not supported"),
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
        code, answer = server.request(path, body)
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
    assert server.request("/health") == (200, {"status": "ok"})


def test_key_budget_queue_and_sigint(reference):
    """A server with --api-key, a KV budget of about one conversation and a queue of one: a request without the
    key is a 401; a second conversation evicts the first (which then re-prefills, exact, reusing nothing) while
    its own next turn reuses it; requests past the queue are a 503 with Retry-After; SIGINT to the launcher stops
    every rank in step."""
    tok, generate = reference
    s = Server(2, "--api-key", "sesame", "--kv-budget", "300KiB", "--max-queue", "1")
    key = {"Authorization": "Bearer sesame"}
    try:
        code, body = s.request("/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert code == 401 and "API key" in body["error"]["message"]

        def complete(ids, n=4):
            code, body = s.request("/v1/completions", {"prompt": ids, "max_tokens": n}, key)
            assert code == 200, body
            return body

        first, second = tok("Tolvik " + DOC[:500]).input_ids, tok("Amberly " + DOC[500:1000]).input_ids
        a, b = complete(first), complete(second)  # ~150 tokens each: B's KV and A's do not both fit
        b_next = second + tok(b["choices"][0]["text"]).input_ids + tok(" And then?").input_ids
        got = complete(b_next)
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(second)
        a_next = first + tok(a["choices"][0]["text"]).input_ids + tok(" And then?").input_ids
        got = complete(a_next)
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] < 5  # evicted: prefilled again
        assert got["choices"][0]["text"] == tok.decode(generate(a_next, 4), skip_special_tokens=True)
        long = tok(DOC * 4).input_ids  # its KV alone is over the budget: refused before it runs, named
        code, body = s.request("/v1/completions", {"prompt": long, "max_tokens": 4}, key)
        assert code == 400 and "--kv-budget" in body["error"]["message"], body
        unasked = s.request("/v1/completions", {"prompt": second}, key)[1]  # no max_tokens: what fits
        assert 0 < unasked["usage"]["completion_tokens"] < 300, unasked
        codes = [None] * 5

        def ask(i):
            codes[i] = s.request("/v1/completions", {"prompt": DOC[:300], "max_tokens": 60}, key, with_headers=True)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        busy = [(body, head) for code, body, head in codes if code == 503]
        assert busy and all("waiting" in b["error"]["message"] and h.get("retry-after") == "1" for b, h in busy), codes
        assert sum(code == 200 for code, _, _ in codes) >= 2, codes  # the one running and the one waiting
    finally:
        rc = s.stop()
    # every rank stopped in step; torchrun itself re-raises the SIGINT it got (exit status 1 after its workers' 0)
    out = "".join(s.lines)
    assert "stopped: every rank left in step" in out and "Root Cause" not in out and rc in (0, 1), out[-3000:]


def test_a_killed_rank_fails_the_request_and_every_process_exits():
    """Ranks started without a launcher (as on several nodes), rank 1 killed: the next request fails with a 5xx
    and an error body, /health turns 503, and rank 0 exits non-zero within the timeout (no hang)."""
    s = Server(2, ranks=True, timeout=10)
    try:
        s.ranks[1].kill()
        s.ranks[1].wait()
        code, body = s.request("/v1/completions", {"prompt": "hello", "max_tokens": 3})
        assert code >= 500 and "failed" in body["error"]["message"], (code, body)
        assert s.request("/health")[0] == 503
        s.proc.wait(30)
    finally:
        s.stop()
    assert s.proc.returncode not in (0, None), "".join(s.lines[-30:])
