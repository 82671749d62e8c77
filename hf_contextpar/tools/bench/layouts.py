"""`python -m hf_contextpar.tools.bench.layouts`: TP x CP layouts of one model on the same ranks, in one run.

    torchrun --nproc_per_node 4 -m hf_contextpar.tools.bench.layouts --tp 1,2,4 --length 2048

For each tp (tp x cp = the world; tp = 1 is context parallelism alone, cp = 1 tensor parallelism
alone) the model is loaded over that mesh (hf_contextpar.mesh, weights read sharded), patched over
its CP group, and measured on every rank: TTFT (one prefill forward, median of --repeats after a
warm-up), TTIT (the decode steps of a greedy generate), the weights and KV cache the rank holds and
the attention bytes it sent in the prefill (CP's traffic; TP's all-reduces inside transformers'
layers are not counted). Rank 0 first times the unpatched model alone, and every layout's greedy
tokens are checked against it. The default model is a built-in tiny Llama with 8 query and 4 KV
heads, so that TP 4 holds whole KV heads; with `--kv-heads 2`, TP 4 runs DCP 2 (two TP ranks per KV
head, each holding half its tokens), and the DCP group's traffic (query heads gathered, partials
merged) is its own column.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from ...api import STRATEGIES
from ...cache.sharded import returned_cache
from ...cliargs import exits_cleanly, positive_int, positive_ints, writable_file
from ...errors import ContextParallelError
from ...mesh import dcp_of
from ...models import DTYPES, load, tiny_model
from ..tpload import load_tp, weight_bytes
from .measure import kv_bytes


@torch.no_grad()
def measure(model, ids, new_tokens: int, repeats: int, runtime) -> dict:
    """TTFT (median prefill forward), TTIT, tokens, KV bytes and prefill attention bytes sent, this rank."""
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True)
    model.generate(ids[:, :64], max_new_tokens=2, do_sample=False)  # warm-up
    times, sent, dcp_sent = [], 0, 0
    dcp = runtime.patched.dcp.tagged["attention"] if runtime is not None and runtime.patched.dcp is not None else None
    for _ in range(repeats):
        dist.barrier()
        before = dcp.bytes_sent if dcp is not None else 0
        start = time.perf_counter()
        model(ids, logits_to_keep=1).logits.argmax(-1)
        times.append(time.perf_counter() - start)
        if runtime is not None:
            sent = runtime.last_forward["bytes_sent"]
        dcp_sent = dcp.bytes_sent - before if dcp is not None else 0
    dist.barrier()
    start = time.perf_counter()
    out = model.generate(ids, **kw)
    total = time.perf_counter() - start
    ttft = statistics.median(times)
    ttit = max(0.0, total - ttft) / max(1, new_tokens - 1)
    kv = kv_bytes(returned_cache(out))
    return dict(ttft=ttft, ttit=ttit, tokens=out.sequences, kv=kv, sent=sent, dcp_sent=dcp_sent)


def layout_row(args, tp: int, ids, reference, device) -> dict:
    import hf_contextpar

    world, dtype = dist.get_world_size(), DTYPES[args.dtype]
    row = dict(tp=tp, cp=world // tp)
    overrides = dict(num_key_value_heads=args.kv_heads, num_attention_heads=args.heads) if args.kv_heads else {}
    try:
        if world % tp:
            raise ContextParallelError(f"tp={tp} does not divide the {world} processes")
        model, _, cp_group, _ = load_tp(args.model, tp, dtype, device, **overrides)
    except ContextParallelError as e:
        return dict(row, refused=f"{type(e).__name__}: {e}")
    dcp = dcp_of(model)
    row["dcp"] = dcp[2] if dcp is not None else 1
    if row["cp"] > 1 or dcp is not None:  # DCP runs the engine even over one CP rank
        hf_contextpar.apply_context_parallel(model, group=cp_group, strategy=args.strategy)
    runtime = hf_contextpar.get_runtime(model)
    got = measure(model, ids, args.new_tokens, args.repeats, runtime)
    mine = torch.tensor([weight_bytes(model), got["kv"], got["sent"], got["dcp_sent"]], dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    everyone = torch.stack(everyone)
    hf_contextpar.remove_context_parallel(model)
    del model
    return dict(
        row,
        ttft_s=got["ttft"],
        ttit_s=got["ttit"],
        weights_per_rank=everyone[:, 0].max().item(),
        kv_per_rank=everyone[:, 1].max().item(),
        sent_per_rank=everyone[:, 2].max().item(),
        dcp_sent_per_rank=everyone[:, 3].max().item(),
        tokens_identical=bool(torch.equal(got["tokens"].cpu(), reference)),
    )


def fmt_rows(args, rows, base) -> str:
    mib = 2**20
    lines = [
        f"model {args.model} ({args.heads or 'its'} query / {args.kv_heads or 'its'} KV heads), {args.dtype}, prompt "
        f"{args.length} tokens, {args.new_tokens} new, strategy {args.strategy}, {dist.get_world_size()} processes",
        f"unpatched, 1 process: TTFT {base['ttft'] * 1e3:.1f} ms, TTIT {base['ttit'] * 1e3:.2f} ms, weights "
        f"{base['weights'] / mib:.2f} MiB, KV {base['kv'] / mib:.2f} MiB",
        "",
        "| layout | TTFT | TTIT | weights / rank | KV / rank | CP bytes sent / rank | DCP bytes sent / rank "
        "| tokens identical |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        name = f"TP {r['tp']} x CP {r['cp']}" + (f" (DCP {r['dcp']})" if r.get("dcp", 1) > 1 else "")
        if "refused" in r:
            lines.append(f"| {name} | refused: {r['refused']} | | | | | | |")
            continue
        lines.append(
            f"| {name} | {r['ttft_s'] * 1e3:.1f} ms | {r['ttit_s'] * 1e3:.2f} ms | {r['weights_per_rank'] / mib:.2f} MiB | "
            f"{r['kv_per_rank'] / mib:.2f} MiB | {r['sent_per_rank'] / mib:.2f} MiB | "
            f"{r['dcp_sent_per_rank'] / mib:.2f} MiB | {r['tokens_identical']} |"
        )
    return "\n".join(lines)


def run(args):
    from ...mesh import init_world

    device = torch.device("cpu")
    init_world(device.type)
    torch.set_num_threads(args.threads)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, args.length), generator=g)
    overrides = dict(num_key_value_heads=args.kv_heads, num_attention_heads=args.heads) if args.kv_heads else {}
    base = [None]
    if rank == 0:  # the unpatched model alone (the others wait at the broadcast)
        if args.model.startswith("tiny-"):
            whole = tiny_model(args.model[5:], dtype=DTYPES[args.dtype], **overrides)
        else:
            whole = load(args.model, DTYPES[args.dtype], device)[0]
        with torch.no_grad():
            start = time.perf_counter()
            whole(ids, logits_to_keep=1)
            ttft = time.perf_counter() - start
            start = time.perf_counter()
            kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
            out = whole.generate(ids, **kw, return_dict_in_generate=True)
            ttit = max(0.0, time.perf_counter() - start - ttft) / max(1, args.new_tokens - 1)
        base = [
            dict(
                ttft=ttft,
                ttit=ttit,
                tokens=out.sequences,
                weights=weight_bytes(whole),
                kv=kv_bytes(returned_cache(out)),
            )
        ]
        del whole
    dist.broadcast_object_list(base, src=0)
    rows = [layout_row(args, tp, ids, base[0]["tokens"], device) for tp in args.tp]
    if rank == 0:
        text = fmt_rows(args, rows, base[0])
        print(text, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(rows=rows, unpatched={k: v for k, v in base[0].items() if k != "tokens"}), f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m hf_contextpar.tools.bench.layouts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="tiny-llama_gqa4", help="hub id, local dir, built-in (default tiny-llama_gqa4)")
    p.add_argument("--heads", type=positive_int, default=8, help="query heads of a tiny model (default 8)")
    p.add_argument("--kv-heads", type=positive_int, default=4, help="KV heads of a tiny model (default 4)")
    p.add_argument("--tp", type=positive_ints, default="1,2,4", help="TP sizes to compare (default 1,2,4)")
    p.add_argument("--length", type=positive_int, default=2048, help="prompt tokens (default 2048)")
    p.add_argument("--new-tokens", type=positive_int, default=8)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--strategy", default="ring_pass_kv", choices=STRATEGIES)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per process (default 1)")
    p.add_argument("--out", type=writable_file, help="write the rows as JSON")
    args = p.parse_args(argv)
    if not args.model.startswith("tiny-"):
        args.heads = args.kv_heads = None
    exits_cleanly(run)(args)


if __name__ == "__main__":
    main()
