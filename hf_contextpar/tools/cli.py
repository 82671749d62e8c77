"""`python -m hf_contextpar generate`: the main job, launched with torchrun or accelerate.

    torchrun --nproc_per_node 2 -m hf_contextpar generate
    torchrun --nproc_per_node 2 -m hf_contextpar generate --prompt-tokens 8192 --depth 25 --needle 2
    torchrun --nproc_per_node 2 -m hf_contextpar generate --model meta-llama/Llama-3.2-1B --prompt-file book.txt

By default it runs the built-in trained model (needle-lm) on a NeedleBench prompt: a fact (a
built-in needle) hidden at `--depth` % of `--prompt-tokens` tokens of English text shipped with
Python, and a question about it at the end. Rank 0 prints the needle, the question, the model's
answer and whether it is right, the time to first token, decode tokens/s and every rank's
KV-cache size, then the unpatched model's run on one process (rank 0 alone, before the
context-parallel run; `--no-baseline` skips it) and whether the tokens are identical (`--csa`: the
approximate mode, compared, never called identical). `--prompt-file` continues a text file instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from ..api import DECODES, STRATEGIES
from ..cache.sharded import returned_cache
from ..cliargs import (
    add_csa_arguments,
    csa_setting,
    exits_cleanly,
    fractions,
    nonnegative_int,
    percent,
    positive_int,
    positive_ints,
    writable_file,
)
from ..mesh import dcp_of
from ..models import DEFAULT_MODEL, DTYPES, LOAD_DTYPES, load, load_dtype, max_positions


def needle_prompt(tok, tokens: int, depth: int, needle: int, seed: int = 0):
    """A NeedleBench single-needle prompt (the eval harness's builder and built-in needles), `tokens` long."""
    from ..eval import needlebench as nb

    data = nb.builtin_data()
    if not 0 <= needle < len(data.needles):
        raise SystemExit(f"--needle must be 0..{len(data.needles) - 1}")
    n = data.needles[needle]
    _, hay = nb.haystack_ids(data, tok, tokens, seed)
    try:
        return nb.build_prompt(
            "single_retrieval", tokens, depth, ([n["needle"]], n["retrieval_question"], [n["arg2"]]), hay, tok
        )
    except nb.DataError as e:
        raise SystemExit(f"{e} (--prompt-tokens {tokens})") from None


class _FirstToken:
    """A generate() streamer that timestamps the first new token."""

    def __init__(self):
        self.calls, self.first = 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter()

    def end(self):
        pass


def _warm_up(model, inputs):
    """One short generate so the timed run pays no one-off costs (process-group connections, allocator)."""
    short = {k: v[:, : min(64, v.shape[1])] for k, v in inputs.items()}
    with torch.no_grad():
        model.generate(**short, max_new_tokens=2, do_sample=False)


def _timed_generate(model, inputs, max_new_tokens):
    """Greedy generate up to `max_new_tokens` (stops at EOS); (output, TTFT s, decode tokens/s)."""
    _warm_up(model, inputs)
    streamer = _FirstToken()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, streamer=streamer, return_dict_in_generate=True
        )
    end = time.perf_counter()
    new = out.sequences.shape[1] - inputs["input_ids"].shape[1]
    ttft = (streamer.first or end) - start
    tok_s = (new - 1) / (end - streamer.first) if new > 1 else float("nan")
    return out, ttft, tok_s


def cmd_generate(args):
    import hf_contextpar

    rank = int(os.environ.get("RANK", "0"))
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu")
    tp_group = None
    if args.tp > 1:  # weights read already sharded (tpload); the baseline loads the whole model on rank 0
        from .tpload import load_tp

        model, tok, cp_group, tp_group = load_tp(args.model, args.tp, load_dtype(args.dtype), device)
    else:
        model, tok = load(args.model, load_dtype(args.dtype), device)
    task = None
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            text = f.read()
        ids = tok(text, return_tensors="pt").input_ids[:, : args.prompt_tokens]
        if ids.numel() == 0:
            raise SystemExit(f"error: --prompt-file {args.prompt_file} holds no text the tokenizer turns into tokens.")
    else:
        task = needle_prompt(tok, args.prompt_tokens, args.depth, args.needle)
        ids = torch.tensor([task.ids])
    limit = max_positions(model)
    if limit and ids.shape[1] + args.max_new_tokens > limit:
        raise SystemExit(
            f"error: the prompt ({ids.shape[1]} tokens) plus --max-new-tokens ({args.max_new_tokens}) exceeds the "
            f"model's context ({limit} positions); use a smaller --prompt-tokens."
        )
    inputs = {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}

    baseline = None
    if args.baseline and rank == 0:
        whole = load(args.model, load_dtype(args.dtype), device)[0] if tp_group is not None else model
        out, ttft, tok_s = _timed_generate(whole, inputs, args.max_new_tokens)
        baseline = (out.sequences, ttft, tok_s)
        del whole
    hf_contextpar.apply_context_parallel(
        model,
        strategy=args.strategy,
        decode=args.decode,
        timeout=args.timeout,
        partitions=args.partitions,
        sparse=csa_setting(args),
        **(dict(group=cp_group) if tp_group is not None else {}),
    )
    runtime = hf_contextpar.get_runtime(model)
    world = runtime.world if runtime else 1
    if dist.is_initialized():
        dist.barrier()  # ranks start together (and wait for the baseline)
    out, ttft, tok_s = _timed_generate(model, inputs, args.max_new_tokens)
    cache = returned_cache(out)
    local = torch.tensor(
        [
            cache.local_length if runtime else cache.get_seq_length(),
            cache.local_nbytes() if runtime else sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers),
        ]
    )
    if tp_group is not None:  # every rank of the mesh: KV and weights (r = cp index * tp + tp index)
        from .tpload import weight_bytes

        local = torch.cat([local, torch.tensor([weight_bytes(model)])]).to(device)
        per_rank = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(per_rank, local)
        per_rank = torch.stack(per_rank).cpu()
    else:
        per_rank = (
            runtime.comm.all_gather(local.to(device if cuda else "cpu"), tag="control").cpu()
            if runtime
            else local[None]
        )
    if rank == 0:
        new = out.sequences[0, ids.shape[1] :]
        answer = tok.decode(new, skip_special_tokens=True)
        if task is None:
            print(answer)
        else:
            needle = task.needles[0].strip()
            at = len(tok(task.context[: task.needle_at[0]], add_special_tokens=False).input_ids)
            found = task.keywords[0] in answer
            print(f"needle   (depth {args.depth}%, about token {at} of {ids.shape[1]}): {needle}")
            print(f"question: {task.question}")
            print(f"answer:   {answer.strip()}")
            print(f"expected: {task.keywords[0]!r} -> {'correct' if found else 'WRONG'}")
        print("-" * 60)
        layout = f"TP {args.tp} x CP {world}" if tp_group is not None else f"{world}"
        if dcp_of(model) is not None:  # TP ranks sharing a KV head, each holding 1/dcp of its tokens
            layout += f" (DCP {dcp_of(model)[2]})"
        print(
            f"model {args.model}  dtype {str(model.dtype).split('.')[-1]}  processes {layout}  prompt {ids.shape[1]} tokens  "
            f"new {new.numel()} tokens  threads/process {torch.get_num_threads()}"
        )
        print(f"TTFT {ttft * 1000:.1f} ms   decode {tok_s:.1f} tokens/s")
        for r, (tokens, nbytes, *weights) in enumerate(per_rank.tolist()):
            where = f" (cp {r // args.tp}, tp {r % args.tp})" if tp_group is not None else ""
            held = f", weights {weights[0] / 2**20:.2f} MiB" if weights else ""
            print(f"  rank {r}{where}: KV cache {tokens} tokens/layer, {nbytes / 2**20:.2f} MiB{held}")
        if approximate := runtime is not None and runtime.approximate:  # never "identical": it is not meant to be
            print(f"approximate ({', '.join(runtime.approximate)}): CSA drops distant tokens, not the exact result")
        if baseline is not None:
            same = torch.equal(baseline[0].cpu(), out.sequences.cpu())
            verdict = f"tokens as the exact run's: {same}" if approximate else f"tokens identical: {same}"
            print(
                f"unpatched, 1 process: TTFT {baseline[1] * 1000:.1f} ms   decode {baseline[2]:.1f} tokens/s   "
                f"TTFT speed-up {baseline[1] / ttft:.2f}x   {verdict}"
            )
        sys.stdout.flush()
    if dist.is_initialized():
        dist.barrier()  # nobody tears the group down while a peer still uses it
        dist.destroy_process_group()


def _setup(args):
    """Model and patch for the calibrate / sweep commands."""
    import hf_contextpar

    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu")
    model, _ = load(args.model, DTYPES[args.dtype], device)
    hf_contextpar.apply_context_parallel(model, calibration=getattr(args, "calibration", None))
    runtime = hf_contextpar.get_runtime(model)
    if runtime is None:
        raise SystemExit("run this command under torchrun (or accelerate launch) with at least 2 processes.")
    return model, runtime, device


def cmd_calibrate(args):
    from .calibrate import measure

    model, runtime, device = _setup(args)
    cal = measure(runtime.patched.shape, DTYPES[args.dtype], device, group=runtime.comm.group, tokens=args.tokens)
    if runtime.rank == 0:
        path = cal.save(args.out)
        print(f"C  (attention, achieved) = {cal.attn_flops / 1e9:.2f} GFLOP/s per rank")
        print(f"C  (linear layers)       = {cal.gemm_flops / 1e9:.2f} GFLOP/s per rank")
        print(f"BW (ring send/recv)      = {cal.bandwidth / 1e9:.3f} GB/s")
        print(f"latency (small collective) = {cal.latency * 1e3:.3f} ms")
        print(f"saved to {path}")
    dist.barrier()
    dist.destroy_process_group()


def cmd_sweep(args):
    import json

    from .calibrate import format_sweep, miss_rate_sweep

    model, runtime, device = _setup(args)
    rows, coeffs = miss_rate_sweep(model, runtime, args.total, args.miss_rates, repeats=args.repeats, device=device)
    if runtime.rank == 0:
        cal = runtime.settings.calibration
        print(
            f"model {args.model}  N={runtime.world}  total context {args.total}  threads/rank {torch.get_num_threads()}  "
            f"C={cal.attn_flops / 1e9:.2f} GFLOP/s  BW={cal.bandwidth / 1e9:.3f} GB/s ({cal.source})"
        )
        print(format_sweep(rows, coeffs))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(rows=rows, h_refit=coeffs), f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def cmd_kvr_table(args):
    from .calibrate import kvr_table

    model, runtime, device = _setup(args)
    lengths = args.lengths
    if min(lengths) < runtime.world:
        raise SystemExit(f"error: --lengths must be at least the number of processes ({runtime.world}); got {lengths}")
    log = print if runtime.rank == 0 else None
    table = kvr_table(model, runtime, lengths, points=args.points, repeats=args.repeats, device=device, log=log)
    if runtime.rank == 0:
        table.details.update(model=args.model, dtype=args.dtype)
        print(
            f"saved to {table.save(args.out)}; use apply_context_parallel(model, strategy='kv_runahead', "
            f"partitions='{args.out}')"
        )
    dist.barrier()
    dist.destroy_process_group()


def _serve(args):
    from .serve.command import run

    try:
        import fastapi  # noqa: F401
        import openai  # noqa: F401
        import uvicorn  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name not in ("fastapi", "uvicorn", "openai", "starlette"):
            raise
        raise SystemExit("error: serve needs FastAPI, uvicorn and openai: pip install 'hf-contextpar[serve]'") from None
    run(args)


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m hf_contextpar", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="context-parallel generate() on one prompt")
    g.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"hub id, local dir, or built-in needle-lm / tiny-<family> (default {DEFAULT_MODEL})",
    )
    g.add_argument(
        "--prompt-file", help="generate a continuation of this UTF-8 text file instead of answering a needle question"
    )
    g.add_argument(
        "--prompt-tokens",
        type=positive_int,
        default=4096,
        help="prompt length in tokens (a file is truncated to it; default 4096: needle-lm finds needle 0 up to 8K)",
    )
    g.add_argument("--depth", type=percent, default=50, help="where the needle sits, %% of the haystack (default 50)")
    g.add_argument(
        "--needle", type=int, default=0, help="which built-in needle (hf_contextpar.eval.needles.NEEDLES) to hide"
    )
    g.add_argument(
        "--max-new-tokens", type=positive_int, default=32, help="at most this many new tokens (stops at EOS)"
    )
    g.add_argument("--dtype", choices=LOAD_DTYPES, default="auto", help="default: the checkpoint's own (auto)")
    g.add_argument("--strategy", default="auto", choices=STRATEGIES, help="prefill algorithm (default: the planner)")
    g.add_argument(  # one prompt: batched pass-Q decode (B >= N) never applies
        "--decode",
        default="auto",
        choices=[d for d in DECODES if d != "ring_pass_q"],
        help="decode algorithm (one sequence: replicated decode)",
    )
    g.add_argument(
        "--partitions",
        "--kvr-partitions",  # its former name
        dest="partitions",
        help="the contiguous partitions of KV-Runahead, CSA and the recurrent state chain: a partition table from "
        "`kvr-table`, 'balanced' (the default: equal work per rank, as measured) or 'even' (each rank keeps 1/N of "
        "the KV either way); --kvr-partitions is its former name",
    )
    add_csa_arguments(g)
    g.add_argument("--threads", type=nonnegative_int, default=0, help="torch threads per process (default: torch's)")
    g.add_argument("--timeout", type=float, default=None, help="seconds to wait for a peer before failing")
    g.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the unpatched model on rank 0 alone and compare (default on)",
    )
    g.add_argument("--cpu", action="store_true", help="stay on CPU even if CUDA is available")
    g.add_argument(
        "--tp",
        type=positive_int,
        default=1,
        help="tensor parallelism inside groups of this many consecutive ranks (transformers' TP plan, weights "
        "read sharded), context parallelism across the groups (default 1: context parallelism alone)",
    )
    g.set_defaults(func=cmd_generate)

    def common(sp):
        sp.add_argument("--model", default="tiny-llama_gqa8")
        sp.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
        sp.add_argument("--threads", type=nonnegative_int, default=0)
        sp.add_argument("--cpu", action="store_true")

    c = sub.add_parser("calibrate", help="measure attention FLOP/s and ring bandwidth for the planner")
    common(c)
    c.add_argument("--tokens", type=positive_int, default=2048, help="query/key block length for the kernel timing")
    c.add_argument(
        "--out",
        type=writable_file,
        help="where to save (default: $HF_CONTEXTPAR_CALIBRATION or ~/.cache/hf_contextpar/)",
    )
    c.set_defaults(func=cmd_calibrate)
    w = sub.add_parser("sweep", help="time pass-KV vs pass-Q over KV-cache miss rates; check the planner")
    common(w)
    w.add_argument("--total", type=positive_int, default=8192, help="total context T+P")
    w.add_argument("--miss-rates", type=fractions, default="0.005,0.01,0.025,0.05,0.1,0.25,0.5,1.0")
    w.add_argument("--repeats", type=positive_int, default=3)
    w.add_argument("--calibration", help="calibration JSON (default: the saved one, else defaults)")
    w.add_argument("--out", type=writable_file, help="write the table as JSON")
    w.set_defaults(func=cmd_sweep)
    k = sub.add_parser(
        "kvr-table", help="search KV-Runahead partitions (KVR-S) at several lengths; save the table (KVR-P)"
    )
    common(k)
    k.add_argument("--lengths", type=positive_ints, default="1024,2048,4096", help="context lengths to search")
    k.add_argument("--points", type=positive_int, default=5, help="grid points per boundary and level")
    k.add_argument("--repeats", type=positive_int, default=3)
    k.add_argument("--out", type=writable_file, default="kvr_partitions.json")
    k.set_defaults(func=cmd_kvr_table)
    r = sub.add_parser("predict", help="predicted TTFT, TTIT, KV and traffic per strategy from the cost model (no run)")
    from .predict import add_arguments
    from .predict import run as predict

    add_arguments(r)
    r.set_defaults(func=predict)
    t = sub.add_parser("selftest", help="exactness matrix + short benchmark on this machine (or --simulated)")
    from .selftest import add_arguments as selftest_arguments
    from .selftest import run as selftest

    selftest_arguments(t)
    t.set_defaults(func=selftest)
    v = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server over the context-parallel model (rank 0 listens)"
    )
    from .serve.command import add_arguments as serve_arguments

    serve_arguments(v)
    v.set_defaults(func=_serve)
    sub.add_parser("lm_eval", add_help=False, help="lm-evaluation-harness with the hf-cp model (lm-eval's own flags)")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["lm_eval"]:  # everything after it is lm-eval's: tools/lmeval.py
        try:
            from .lmeval import main as lm_eval
        except ModuleNotFoundError as e:
            if not (e.name or "").startswith("lm_eval"):
                raise
            raise SystemExit(
                "error: lm_eval needs lm-evaluation-harness: pip install 'hf-contextpar[lmeval]'"
            ) from None
        return exits_cleanly(lm_eval)(argv[1:])
    args = p.parse_args(argv)
    exits_cleanly(args.func)(args)
