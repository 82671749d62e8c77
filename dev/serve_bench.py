"""The server's figures (issue 60, item 11): a follow-up turn over a long history against re-prefilling it, and
throughput with p50 / p99 time to first token at several concurrent clients.

    python dev/serve_bench.py --nproc 2 --lengths 4096,16384,32768          # turns
    python dev/serve_bench.py --nproc 2 --clients 1,4,8 --requests 6       # concurrency
    python dev/serve_bench.py --nproc 2 --lengths 4096 --clients 1,4,8      # both

It starts `torchrun --nproc_per_node N -m hf_contextpar serve` (needle-lm by default, one thread a rank) as a user
does and drives it over raw HTTP, every request as token ids (/v1/completions), streamed, so the time to the first
token is the prefill's:

- **turns**: a first request of L tokens of English text and a question, 8 new tokens; its follow-up (the first
  request's tokens, its answer and a second question) reusing the kept sharded KV; the same follow-up with its
  first token changed, which reuses nothing (a re-prefill of the whole history). TTFT of each, the reused tokens,
  and the ratio follow-up / re-prefill. The follow-up's answer is checked against the unpatched model on one
  process, in this script (greedy: the same tokens), not assumed.
- **concurrency**: C clients at once, each sending R requests of about 1K tokens with 16 new tokens (distinct
  prompts: no reuse); p50 and p99 TTFT over all requests, completion tokens per second over the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

from transformers import AutoTokenizer

from hf_contextpar.models import builtin_model_path, sample_text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(nproc: int, model: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    cmd += ["--master_port", str(free_port()), "-m", "hf_contextpar", "serve", model, "--port", "0"]
    cmd += ["--served-name", "bench", "--max-queue", "256"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if m := re.search(r"serving .* on (http://\S+/v1)", line):
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
            return proc, m[1]
    raise SystemExit("the server did not start")


def timed(url: str, ids: list[int], new: int) -> tuple[float, float, str, int]:
    """(TTFT s, total s, text, cached tokens) of one streamed completions request, over raw HTTP: the `openai`
    client spends 15 us a token preparing a prompt of token ids (0.45 s for 32K), which is not the server's."""
    body = json.dumps({"model": "bench", "prompt": ids, "max_tokens": new, "stream": True}).encode()
    req = urllib.request.Request(url + "/completions", data=body, headers={"Content-Type": "application/json"})
    t0, first, parts, cached = time.perf_counter(), None, [], 0
    with urllib.request.urlopen(req, timeout=3600) as response:
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            text = "".join(c.get("text", "") for c in chunk.get("choices", []))
            if text and first is None:
                first = time.perf_counter() - t0
            parts.append(text)
            usage = chunk.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached)
    return first or time.perf_counter() - t0, time.perf_counter() - t0, "".join(parts), cached


def one_process(model_name: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(builtin_model_path(model_name) or model_name, dtype="auto").eval()

    def answer(ids: list[int], new: int) -> list[int]:
        with torch.no_grad():
            return model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False)[0, len(ids) :].tolist()

    return answer


def turns(url, tok, lengths: list[int], reference) -> None:
    text = sample_text(4 * max(lengths) + 4000)
    q1 = tok("\n\nNow, the question is: What is the pass key?\n").input_ids
    q2 = tok("\n\nNow, the question is: Where are the oars?\n").input_ids
    print(
        "| history | first turn | follow-up (reused tokens) | re-prefill | follow-up / re-prefill | / first turn | exact |"
    )
    print("|---:|---:|---:|---:|---:|---:|:---:|")
    for length in lengths:
        doc = tok(text).input_ids[:length]
        first = doc + q1
        t1, _, answer, _ = timed(url, first, 8)
        follow = first + tok(answer, add_special_tokens=False).input_ids + q2
        t2, _, a2, cached = timed(url, follow, 8)
        fresh = [follow[0] + 1, *follow[1:]]  # another first token: nothing to reuse
        t3, _, _, _ = timed(url, fresh, 8)
        print(
            f"| {length:,} | {t1 * 1e3:,.0f} ms | {t2 * 1e3:,.0f} ms ({cached:,}) | {t3 * 1e3:,.0f} ms "
            f"| {t2 / t3:.3f} | {t2 / t1:.3f} | {a2 == tok.decode(reference(follow, 8), skip_special_tokens=True)} |",
            flush=True,
        )


def concurrency(url, tok, clients: list[int], requests: int) -> None:
    text = sample_text(200_000)
    words = text.split()
    print("| clients | requests | p50 TTFT | p99 TTFT | completion tokens/s |")
    print("|---:|---:|---:|---:|---:|")
    for c in clients:
        prompts = [tok(" ".join(words[(i * 997) % 20000 :][:700])).input_ids[:1024] for i in range(c * requests)]
        ttfts, lock = [], threading.Lock()

        def run(k):
            for i in range(k, len(prompts), c):
                ttft, _, _, _ = timed(url, prompts[i], 16)
                with lock:
                    ttfts.append(ttft)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=run, args=(k,)) for k in range(c)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        q = statistics.quantiles(ttfts, n=100)
        print(
            f"| {c} | {len(prompts)} | {statistics.median(ttfts) * 1e3:,.0f} ms | {q[98] * 1e3:,.0f} ms "
            f"| {16 * len(prompts) / wall:.1f} |",
            flush=True,
        )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--model", default="needle-lm")
    p.add_argument("--lengths", default="", help="history lengths for the turns (tokens, comma-separated)")
    p.add_argument("--clients", default="", help="concurrent clients (comma-separated)")
    p.add_argument("--requests", type=int, default=6, help="requests per client")
    args = p.parse_args()
    tok = AutoTokenizer.from_pretrained(builtin_model_path(args.model) or args.model)
    proc, url = start(args.nproc, args.model)
    try:
        print(f"server: {args.model} on {args.nproc} processes, one thread each")
        if args.lengths:
            turns(url, tok, [int(x) for x in args.lengths.split(",")], one_process(args.model))
        if args.clients:
            concurrency(url, tok, [int(x) for x in args.clients.split(",")], args.requests)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(120)


if __name__ == "__main__":
    main()
