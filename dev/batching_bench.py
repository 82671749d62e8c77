"""Should the server batch requests that arrive together (issue 60, item 6)? Queued in order against one padded
batch through the batched decode, side by side in one run, on the model the server runs.

    torchrun --nproc_per_node 2 dev/batching_bench.py --requests 4,8 --prompt 1024 --new 16,64

For each count k of requests arriving at once (distinct prompts of about --prompt tokens, lengths uneven, greedy):
- **queued**: one `generate` per request, in order (what the server does): request i finishes after the first i;
- **batched**: one `generate` of all k, left-padded (every request finishes when the batch does).
Printed: the wall time of each, the mean and the last request's completion time, the completion tokens per
second, and whether the batch's tokens equal the queued ones (they must: a padded batch is exact). Timings are
rank 0's, each the best of --repeat, queued and batched alternating.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import hf_contextpar
from hf_contextpar.models import DEFAULT_MODEL, load, sample_text


def _prompts(tok, k: int, length: int) -> list[list[int]]:
    ids = tok(sample_text(length * (k + 1) * 8)).input_ids
    return [ids[i * length : i * length + length - 37 * i] for i in range(k)]  # distinct, uneven lengths


def _queued(model, prompts, new: int) -> tuple[list[float], list[list[int]]]:
    done, answers, start = [], [], time.perf_counter()
    for ids in prompts:
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False)
        answers.append(out[0, len(ids) :].tolist())
        done.append(time.perf_counter() - start)
    return done, answers


def _batched(model, tok, prompts, new: int) -> tuple[list[float], list[list[int]]]:
    width = max(len(p) for p in prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    x = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    out = model.generate(x, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=pad)
    took = time.perf_counter() - start
    answers = [row[width:].tolist() for row in out]
    return [took] * len(prompts), answers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--requests", default="4,8", help="requests arriving at once (comma-separated)")
    p.add_argument("--prompt", type=int, default=1024, help="about this many tokens each")
    p.add_argument("--new", default="16,64", help="new tokens per request (comma-separated)")
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    model, tok = load(args.model, "auto", torch.device("cpu"))
    hf_contextpar.apply_context_parallel(model)
    rank = dist.get_rank()
    if rank == 0:
        print(f"{args.model}, N = {dist.get_world_size()}, prompts of about {args.prompt} tokens, greedy")
        print("| requests | new | queued s | batched s | mean done queued / batched | tok/s queued / batched | same |")
        print("|---:|---:|---:|---:|---:|---:|:---:|")
    with torch.no_grad():
        for k in map(int, args.requests.split(",")):
            prompts = _prompts(tok, k, args.prompt)
            for new in map(int, args.new.split(",")):
                best_q = best_b = None
                for _ in range(args.repeat):
                    q, q_answers = _queued(model, prompts, new)
                    b, b_answers = _batched(model, tok, prompts, new)
                    best_q = q if best_q is None or q[-1] < best_q[-1] else best_q
                    best_b = b if best_b is None or b[-1] < best_b[-1] else best_b
                b_answers = [a[: len(q)] for a, q in zip(b_answers, q_answers)]  # the queued stop at the end token
                if rank == 0:
                    tokens = sum(len(a) for a in q_answers)
                    mean_q, mean_b = sum(best_q) / k, sum(best_b) / k
                    print(
                        f"| {k} | {new} | {best_q[-1]:.2f} | {best_b[-1]:.2f} | {mean_q:.2f} / {mean_b:.2f} "
                        f"| {tokens / best_q[-1]:.1f} / {tokens / best_b[-1]:.1f} "
                        f"| {'yes' if q_answers == b_answers else 'NO'} |",
                        flush=True,
                    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
