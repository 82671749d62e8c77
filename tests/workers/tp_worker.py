"""One rank of the tensor x context parallel matrix: 4 ranks as TP 2 x CP 2 (hf_contextpar.mesh), each
family's tiny model saved once and read back sharded by transformers' TP plan, then patched over the
CP group; every strategy, both decode modes, a padded batch and two turns against the unpatched
model on one process (fp64), and the disagreements between TP peers (an error on every rank, no
hang). With `dcp` after OUT: the DCP matrix instead (more TP ranks than KV heads: TP 4 x CP 1 on 2 KV
heads, TP 2 x CP 2 on 1, so each KV head's tokens are split 2 ways inside the TP group). Writes
OUT/rank{r}.json."""

from __future__ import annotations

import shutil
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
from hf_contextpar.eval import logits_diff
from records import write_records
from shared_reference import OnRankZero

import hf_contextpar
from hf_contextpar.cache.sharded import returned_cache
from hf_contextpar.mesh import init_world, load_tp_cp, local_numel
from hf_contextpar.models import tiny_model

TP = 2
# family -> (config overrides, strategies); qwen2: QKV bias + a sliding layer, phi3: fused QKV (its TP
# plan gathers the heads back: every rank attends with all 4), qwen3: QK-norm
FAMILIES = {
    "qwen2": ({}, ["ring_pass_kv", "ring_pass_q", "allgather_kv", "kv_runahead", "auto"]),
    "phi3": ({}, ["ring_pass_kv", "ring_pass_q", "ulysses"]),
    "qwen3": ({}, ["ring_pass_kv", "ring_pass_q", "allgather_kv"]),
    # 8 query / 4 KV heads: 4 / 2 per TP rank, so Ulysses splits them over CP 2
    "qwen2_wide": (dict(num_attention_heads=8, num_key_value_heads=4), ["ulysses"]),
}
STRATEGIES = ["ring_pass_kv", "ring_pass_q", "allgather_kv", "kv_runahead", "auto"]
# DCP: name -> (tp, config overrides, strategies); the cache is split cp x dcp ways (2 at TP 4, 4 at TP 2)
DCP = {
    "qwen2_tp4": (4, {}, STRATEGIES),  # TP 4 x CP 1, 2 KV heads: DCP 2 (QKV bias, a sliding layer)
    "qwen3_tp4": (4, {}, ["ring_pass_kv", "ring_pass_q"]),  # QK-norm
    "qwen2_kv1": (2, dict(num_key_value_heads=1), STRATEGIES),  # TP 2 x CP 2, 1 KV head: DCP 2
    "qwen3_kv1": (2, dict(num_key_value_heads=1), ["ring_pass_kv", "allgather_kv"]),
}


def load(family: str, overrides: dict, dtype=torch.float64, tp: int = TP):
    """(TP-sharded model, cp group, unpatched whole model) for a tiny family."""
    model_type = family.split("_")[0]
    where = [tempfile.mkdtemp(prefix="tp_worker_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where, src=0)
    ref = tiny_model(model_type, dtype=dtype, **overrides)
    if dist.get_rank() == 0:
        ref.save_pretrained(where[0])
    dist.barrier()
    try:
        model, cp, _ = load_tp_cp(where[0], tp, dtype, attn_implementation="sdpa")
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(where[0], ignore_errors=True)
    return model, cp, OnRankZero(ref)  # the single-process reference, run once on rank 0 (shared_reference.py)


def batch(seed: int, b: int = 2, t: int = 29):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (b, t), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    return ids, mask


@torch.no_grad()
def prefill_and_generate(model, ref, cp, strategy, decode, seed):
    ids, mask = batch(seed)
    hf_contextpar.apply_context_parallel(model, group=cp, strategy=strategy, decode=decode)
    try:
        diff = logits_diff(model(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits, mask)
        kw = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        same = torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))
        runtime = hf_contextpar.get_runtime(model)
        algorithms, heads = (
            dict(runtime.algorithm_counts),
            (runtime.patched.shape.heads, runtime.patched.shape.kv_heads),
        )
        kv = kv_held(model, ids, mask)
    finally:
        hf_contextpar.remove_context_parallel(model)
    held = sum(local_numel(p) for p in model.parameters()) / sum(p.numel() for p in model.parameters())
    return dict(max_diff=diff, tokens_equal=same, algorithms=algorithms, heads=heads, weights_held=held, kv=kv)


def kv_held(model, ids, mask):
    """(tokens per layer this rank's cache holds, the whole prompt's): after a 6-token greedy generate."""
    kw = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    cache = returned_cache(model.generate(ids, return_dict_in_generate=True, **kw))
    full = [layer.live for layer in cache.layers if layer.window is None]  # phi3's layers all slide: the layout's
    return [max(full) if full else cache.local_length, cache.get_seq_length()]


@torch.no_grad()
def two_turns(model, ref, cp, seed):
    """A padded first turn, a second turn over the cache, then generate() continuing from it."""
    ids, mask = batch(seed)
    more = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(seed + 1))
    hf_contextpar.apply_context_parallel(model, group=cp, strategy="auto")
    try:
        a, b = ref(ids, attention_mask=mask, use_cache=True), model(ids, attention_mask=mask, use_cache=True)
        worst = logits_diff(b.logits, a.logits, mask)
        mask2 = torch.cat([mask, torch.ones_like(more)], 1)
        a2 = ref(more, attention_mask=mask2, past_key_values=a.past_key_values, use_cache=True)
        b2 = model(more, attention_mask=mask2, past_key_values=b.past_key_values, use_cache=True)
        worst = max(worst, logits_diff(b2.logits, a2.logits, torch.ones_like(more)))
        nxt = torch.cat([ids, more, more[:, :3]], 1)
        mask3 = torch.cat([mask2, torch.ones(2, 3, dtype=torch.long)], 1)
        kw = dict(attention_mask=mask3, max_new_tokens=5, min_new_tokens=5, do_sample=False)
        same = torch.equal(
            model.generate(nxt, past_key_values=b2.past_key_values, **kw),
            ref.generate(nxt, past_key_values=a2.past_key_values, **kw),
        )
    finally:
        hf_contextpar.remove_context_parallel(model)
    return dict(max_diff=worst, tokens_equal=same)


@torch.no_grad()
def beam_search(model, ref, cp, seed):
    ids, mask = batch(seed)
    hf_contextpar.apply_context_parallel(model, group=cp, strategy="ring_pass_kv")
    try:
        kw = dict(attention_mask=mask, num_beams=3, max_new_tokens=5, min_new_tokens=5, do_sample=False)
        same = torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))
    finally:
        hf_contextpar.remove_context_parallel(model)
    return dict(max_diff=0.0, tokens_equal=same)


def tp_peers_disagree_on_strategy(model, cp, tp=TP):
    """Odd TP indices ask for pass-Q, even ones for pass-KV: each CP group agrees within itself."""
    strategy = "ring_pass_q" if dist.get_rank() % tp % 2 else "ring_pass_kv"
    hf_contextpar.apply_context_parallel(model, group=cp, strategy=strategy)
    hf_contextpar.remove_context_parallel(model)
    return dict(applied=True)


def cp_group_holds_tp_peers(model):
    """apply_context_parallel on a TP model without the mesh's CP group (the whole world): refused."""
    hf_contextpar.apply_context_parallel(model)
    hf_contextpar.remove_context_parallel(model)
    return dict(applied=True)


@torch.no_grad()
def tp_peers_disagree_on_inputs(model, cp):
    """TP index 1 gets one more token than TP index 0: each CP group's inputs agree within itself."""
    hf_contextpar.apply_context_parallel(model, group=cp, strategy="ring_pass_kv")
    try:
        ids = torch.arange(20 + dist.get_rank() % TP)[None] % 256
        model(ids)
    finally:
        hf_contextpar.remove_context_parallel(model)
    return dict(forward=True)


def dcp_matrix(record):
    """More TP ranks than KV heads (DCP 2 in every layout): each name of DCP in fp64, its strategies with
    replicated decode, batched decode where CP > 1, two turns, beam search, Ulysses and DCP peers that
    disagree refused; fp32 tokens; a fused-QKV plan refused at load."""
    for name, (tp, overrides, strategies) in DCP.items():
        model, cp, ref = load(name, overrides, tp=tp)
        for i, strategy in enumerate(strategies):
            record(name, strategy, prefill_and_generate, model, ref, cp, strategy, "replicated", 20 + i)
        if tp < 4:
            record(name, "ring_pass_q_decode", prefill_and_generate, model, ref, cp, "ring_pass_kv", "ring_pass_q", 7)
        record(name, "two_turns", two_turns, model, ref, cp, 5)
        if name.startswith("qwen2"):
            record(name, "beam_search", beam_search, model, ref, cp, 8)
            record(name, "ulysses_refused", prefill_and_generate, model, ref, cp, "ulysses", "replicated", 3)
            record(name, "strategy_differs", tp_peers_disagree_on_strategy, model, cp, tp)
            record(name, "after_errors", prefill_and_generate, model, ref, cp, "ring_pass_kv", "replicated", 4)
    for name in ("qwen2_tp4", "qwen2_kv1"):
        tp, overrides, _ = DCP[name]
        model, cp, ref = load(name, overrides, torch.float32, tp=tp)
        record(f"{name}_fp32", "ring_pass_q", prefill_and_generate, model, ref, cp, "ring_pass_q", "replicated", 9)
        record(f"{name}_fp32", "auto", prefill_and_generate, model, ref, cp, "auto", "auto", 12)
    record("phi3_kv2", "load", lambda: load("phi3", dict(num_key_value_heads=2), tp=4) and {})


def main():
    torch.set_num_threads(1)
    init_world("cpu")
    records = []

    def record(family, case, fn, *args):
        try:
            records.append(dict(family=family, case=case, **fn(*args)))
        except Exception as e:
            records.append(
                dict(family=family, case=case, error=type(e).__name__, message=f"{e}\n{traceback.format_exc()[-1500:]}")
            )

    if sys.argv[2:] == ["dcp"]:
        dcp_matrix(record)
        write_records(sys.argv[1], records)
        return

    for family, (overrides, strategies) in FAMILIES.items():
        model, cp, ref = load(family, overrides)
        for i, strategy in enumerate(strategies):
            record(family, strategy, prefill_and_generate, model, ref, cp, strategy, "replicated", 10 + i)
        record(family, "ring_pass_q_decode", prefill_and_generate, model, ref, cp, "ring_pass_kv", "ring_pass_q", 7)
        if family == "qwen2":
            record(family, "ulysses_refused", prefill_and_generate, model, ref, cp, "ulysses", "replicated", 3)
            record(family, "two_turns", two_turns, model, ref, cp, 5)
            record(family, "beam_search", beam_search, model, ref, cp, 8)
            record(family, "strategy_differs", tp_peers_disagree_on_strategy, model, cp)
            record(family, "inputs_differ", tp_peers_disagree_on_inputs, model, cp)
            record(family, "world_as_cp_group", cp_group_holds_tp_peers, model)
            record(family, "after_errors", prefill_and_generate, model, ref, cp, "ring_pass_kv", "replicated", 4)
        elif family in ("phi3", "qwen3"):
            record(family, "two_turns", two_turns, model, ref, cp, 6)
    model, cp, ref = load("qwen2", {}, torch.float32)  # fp32: the tokens, and logits within fp32's bound
    record("qwen2_fp32", "ring_pass_q", prefill_and_generate, model, ref, cp, "ring_pass_q", "replicated", 9)
    record("qwen2_fp32", "ring_pass_q_decode", prefill_and_generate, model, ref, cp, "auto", "ring_pass_q", 12)
    write_records(sys.argv[1], records)


if __name__ == "__main__":
    main()
