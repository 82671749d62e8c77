"""One rank of the prefill-strategy matrix (all-gather KV, KV-Runahead, Ulysses) against the unpatched
single-process model, the traffic counters against the analytical formulas, and a KVR-S search on a
small model. Writes OUT/rank{r}.json."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from cp_worker import gathered_equal, impl_for, left_padded, prompt  # noqa: E402
from hf_contextpar.eval import logits_diff  # noqa: E402
from records import write_records  # noqa: E402
from shared_reference import OnRankZero

import hf_contextpar  # noqa: E402
from hf_contextpar.models import tiny_model  # noqa: E402
from hf_contextpar.plan.partitions import even, search  # noqa: E402
from hf_contextpar.plan.sharding import head_tail_plan  # noqa: E402
from hf_contextpar.plan.strategies import STRATEGIES as RECORDS  # noqa: E402
from hf_contextpar.plan.strategies import Rows  # noqa: E402
from hf_contextpar.tools.calibrate import kvr_prefill_seconds  # noqa: E402

FAMILIES = ["llama", "qwen2", "gemma2", "phi3", "gpt_oss", "deepseek_v3", "llama4_text"]
STRATEGIES = ["allgather_kv", "kv_runahead", "ulysses"]


def model_pair(family, dtype, strategy):
    impl = impl_for(family)
    ref = OnRankZero(tiny_model(family, dtype=dtype, attn_implementation=impl))
    cp = tiny_model(family, dtype=dtype, attn_implementation=impl)
    hf_contextpar.apply_context_parallel(cp, strategy=strategy, timeout=120)
    return ref, cp


@torch.no_grad()
def exactness(family, strategy, n, rec):
    for dtype in (torch.float64, torch.float32):
        dname = str(dtype).split(".")[-1]
        try:
            ref, cp = model_pair(family, dtype, strategy)
        except hf_contextpar.UnsupportedModelError as e:
            rec("unsupported", dtype=dname, message=str(e))
            return
        for length in (2 * n + 1, 101):
            ids = prompt(length, seed=length)
            rec("prefill_logits", dtype=dname, length=length, max_diff=logits_diff(cp(ids).logits, ref(ids).logits))
        ids, mask = left_padded([37, 64, 19], seed=7)
        a = ref(ids, attention_mask=mask).logits
        if not torch.isnan(a[mask.bool()]).any():  # HF's fp64 eager Gemma2 NaNs on padded rows
            rec("padded_logits", dtype=dname, max_diff=logits_diff(cp(ids, attention_mask=mask).logits, a, mask))
            out_ref = ref.generate(ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False)
            out = cp.generate(ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False)
            rec("padded_generate", dtype=dname, tokens_equal=torch.equal(out, out_ref), ranks_agree=gathered_equal(out))
        # a second turn over the sharded cache (KV-Runahead runs it with ring pass-KV)
        first, second = prompt(45, seed=1), prompt(2 * n + 3, seed=2)
        ra = ref(first, use_cache=True)
        ca = cp(first, use_cache=True)
        both = torch.cat([first, second], 1)
        rb = ref(second, past_key_values=ra.past_key_values, use_cache=True)
        cb = cp(second, past_key_values=ca.past_key_values, use_cache=True)
        algo = hf_contextpar.get_runtime(cp).last_forward["algorithm"]
        g_ref = ref.generate(both, max_new_tokens=10, do_sample=False)
        g_cp = cp.generate(both, max_new_tokens=10, do_sample=False)
        rec(
            "second_turn",
            dtype=dname,
            algorithm=algo,
            max_diff=logits_diff(cb.logits, rb.logits),
            tokens_equal=torch.equal(g_cp, g_ref),
        )


def expected_bytes(strategy, sizes, rank, n, cfg, e, layers):
    """Bytes (sent, received) of one fresh prefill for this rank, batch 1: the strategy's formula
    (plan/strategies.py, the one the cost model averages) on this prefill's partition sizes."""
    d, h, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    rows = Rows(rank, list(sizes), list(sizes), 2 * kv * d * e, h * d * e, h * (d + 1) * 4)  # partials in fp32
    sent, recv = RECORDS[strategy].traffic(rows)
    return sent * layers, recv * layers


@torch.no_grad()
def traffic(n, rec):
    from hf_contextpar.models import tiny_config

    cfg = tiny_config("phi3")  # 4 query and 4 KV heads: every strategy runs on N = 2 and 4
    for strategy in ("ring_pass_kv", "ring_pass_q", "allgather_kv", "kv_runahead", "ulysses"):
        if strategy == "ulysses" and cfg.num_key_value_heads % n:
            continue
        # KV-Runahead on even partitions (KVR-E): the papers' closed forms hold there (Eq. 7)
        extra = dict(partitions="even") if strategy == "kv_runahead" else {}
        cp = hf_contextpar.apply_context_parallel(tiny_model("phi3"), strategy=strategy, timeout=120, **extra)
        rt = hf_contextpar.get_runtime(cp)
        for length in (64, 101):
            cp(prompt(length, seed=length), use_cache=True)
            plan = even(length, n) if strategy == "kv_runahead" else [len(r) for r in head_tail_plan(length, n)]
            sent, recv = expected_bytes(strategy, plan, rt.rank, n, cfg, 4, cfg.num_hidden_layers)
            rec(
                "traffic",
                strategy=strategy,
                length=length,
                sent=rt.last_forward["bytes_sent"],
                received=rt.last_forward["bytes_received"],
                expected_sent=sent,
                expected_received=recv,
            )
        hf_contextpar.remove_context_parallel(cp)


def kvr_search(n, rec):
    cp = hf_contextpar.apply_context_parallel(tiny_model("llama_gqa8"), strategy="kv_runahead", timeout=120)
    rt = hf_contextpar.get_runtime(cp)
    ids = prompt(384, seed=3)
    sizes, seconds, measured = search(
        384, n, lambda s: kvr_prefill_seconds(cp, rt, ids, s, repeats=1), points=3, min_stride=48
    )
    even_s = measured[tuple(even(384, n))]
    rec(
        "kvr_search",
        sizes=sizes,
        seconds=seconds,
        even_seconds=even_s,
        evaluated=len(measured),
        sizes_agree=gathered_equal(torch.tensor(sizes)),
    )


def grad_mode(n, rec):
    """A plain forward with autograd on (no torch.no_grad()) works, and the caller's grad mode survives."""
    ref = tiny_model("llama")
    cp = hf_contextpar.apply_context_parallel(tiny_model("llama"), timeout=120)
    ids = prompt(77, seed=77)
    out = cp(ids)
    rec("grad_mode", max_diff=logits_diff(out.logits, ref(ids).logits), grad_enabled=torch.is_grad_enabled())


def main():
    out_dir = sys.argv[1]
    torch.set_num_threads(1)
    hf_contextpar.apply_context_parallel(tiny_model("llama"))  # initialises the process group from the env
    n = dist.get_world_size()
    records = []

    def recorder(**fixed):
        return lambda case, **kw: records.append(dict(n=n, case=case, **fixed, **kw))

    jobs = [
        (lambda f=f, s=s: exactness(f, s, n, recorder(family=f, strategy=s)), f"{f}/{s}")
        for f in FAMILIES
        for s in STRATEGIES
    ]
    jobs += [
        (lambda: traffic(n, recorder()), "traffic"),
        (lambda: kvr_search(n, recorder()), "kvr_search"),
        (lambda: grad_mode(n, recorder()), "grad_mode"),
    ]
    for job, name in jobs:
        try:
            job()
        except Exception as e:  # recorded, so one failure does not hide the others
            import traceback

            records.append(dict(n=n, case="error", job=name, error=f"{e}\n{traceback.format_exc()}"))
    write_records(out_dir, records)


if __name__ == "__main__":
    main()
