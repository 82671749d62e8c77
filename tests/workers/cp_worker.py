"""One rank of the exactness matrix. Every rank builds the unpatched reference model in-process
(that *is* the single-process run: nothing distributed touches it), then the patched copy, and
records differences. Writes OUT/rank{r}.json."""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist
from hf_contextpar.eval import first_divergence, logits_diff
from hf_contextpar.patches import REGISTRY
from records import write_records
from shared_reference import OnRankZero

import hf_contextpar
from hf_contextpar.models import tiny_model

FAMILIES = [mt for mt, p in REGISTRY.items() if p.tiny is not None]


def impl_for(family):
    return REGISTRY[family].reference_attn


def gathered_equal(t: torch.Tensor) -> bool:
    """Is `t` bitwise identical on every rank?"""
    if not dist.is_initialized():
        return True
    world = dist.get_world_size()
    bufs = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(bufs, t.contiguous())
    return all(torch.equal(b, bufs[0]) for b in bufs)


def local_tokens(cache) -> int:
    """Tokens this rank's cache holds per layer (N = 1 leaves HF's own DynamicCache in place)."""
    return cache.local_length if isinstance(cache, hf_contextpar.ShardedCache) else cache.get_seq_length()


def per_sequence_spread(cache, batch) -> int:
    """Largest difference, over sequences, between the ranks' token counts for that sequence."""
    if not isinstance(cache, hf_contextpar.ShardedCache):
        return 0
    counts = cache.layout.sequence_counts(batch)
    return int((counts.max(dim=1).values - counts.min(dim=1).values).max())


def pair(family, dtype, seed=0):
    ref = OnRankZero(tiny_model(family, dtype=dtype, seed=seed, attn_implementation=impl_for(family)))
    cp = tiny_model(family, dtype=dtype, seed=seed, attn_implementation=impl_for(family))
    hf_contextpar.apply_context_parallel(cp, timeout=120)
    return ref, cp


def prompt(length, seed, batch=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, length), generator=g)


def left_padded(lengths, seed, pad_id=258):
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), max(lengths)), pad_id)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, -n:] = torch.randint(0, 256, (n,), generator=g)
        mask[i, -n:] = 1
    return ids, mask


def _tied_prefill(family) -> float:
    """Indexed attention (DSA) with every visible key's score tied at 0 (the indexer's head weights zeroed): each
    row's top-k is then torch.topk's pick among equal scores, which every rank must make as one process does."""
    ref, cp = pair(family, torch.float64)
    for model in (ref.model if hasattr(ref, "model") else ref, cp):
        for module in model.modules():
            if hasattr(module, "weights_proj") and hasattr(module, "index_topk"):
                module.weights_proj.weight.data.zero_()
    ids, mask = left_padded([97, 80], seed=97)
    return logits_diff(cp(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits, mask)


@torch.no_grad()
def run_family(family, n, records):
    def rec(case, **kw):
        records.append(dict(family=family, n=n, case=case, **kw))

    lengths = sorted({1, max(1, n - 1), 2 * n + 1, 301})
    for dtype in (torch.float64, torch.float32):
        ref, cp = pair(family, dtype)
        dname = str(dtype).split(".")[-1]
        # prefill logits at all positions
        for length in lengths if dtype == torch.float64 else [2 * n + 1, 301]:
            ids = prompt(length, seed=length)
            d = logits_diff(cp(ids).logits, ref(ids).logits)
            rec("prefill_logits", dtype=dname, length=length, max_diff=d)
        # greedy generate, 32 new tokens, with cache-size check
        for length in (1, 2 * n + 1, 97) if dtype == torch.float64 else (2 * n + 1, 97):
            ids = prompt(length, seed=1000 + length)
            out_ref = ref.generate(ids, max_new_tokens=32, do_sample=False, min_new_tokens=32)
            out = cp.generate(ids, max_new_tokens=32, do_sample=False, min_new_tokens=32, return_dict_in_generate=True)
            total = out.sequences.shape[1] - 1  # the last token's K/V is never computed
            rec(
                "greedy",
                dtype=dname,
                length=length,
                tokens_equal=torch.equal(out.sequences, out_ref),
                diverge=first_divergence(out.sequences, out_ref),
                ranks_agree=gathered_equal(out.sequences),
                cache_tokens=local_tokens(out.past_key_values),
                index_tokens=getattr(out.past_key_values, "index_length", 0),
                cache_bound=math.ceil(total / n) + 1,
            )
        # left-padded batch of 3 prompts of different lengths
        ids, mask = left_padded([37, 64, 19], seed=7)
        mine, theirs = cp(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
        d = logits_diff(mine, theirs, mask)
        if torch.isnan(theirs[mask.bool()]).any():  # HF's fp64 eager softmax runs in fp32 and NaNs on padding
            rec("padded_batch", dtype=dname, reference_nan=True, finite=bool(torch.isfinite(mine[mask.bool()]).all()))
        else:
            out_ref = ref.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, min_new_tokens=32)
            out = cp.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, min_new_tokens=32)
            rec(
                "padded_batch",
                dtype=dname,
                max_diff=d,
                tokens_equal=torch.equal(out, out_ref),
                diverge=first_divergence(out, out_ref),
                ranks_agree=gathered_equal(out),
            )
        # batches of 2 and 5 unequal prompts: batched ring pass-Q decode wherever B >= N
        for lengths in ([23, 57], [37, 64, 19, 50, 41]):
            ids, mask = left_padded(lengths, seed=len(lengths))
            out_ref = ref.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=16,
                min_new_tokens=16,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            counts = hf_contextpar.get_runtime(cp).algorithm_counts.copy() if n > 1 else {}
            out = cp.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=16,
                min_new_tokens=16,
                do_sample=False,
                return_dict_in_generate=True,
            )
            pass_q = (
                (
                    hf_contextpar.get_runtime(cp).algorithm_counts["ring_pass_q_decode"]
                    - counts.get("ring_pass_q_decode", 0)
                )
                if n > 1
                else 0
            )
            if any(torch.isnan(lg).any() for lg in out_ref.logits):  # HF's fp64 eager Gemma2 NaNs on padded rows
                continue
            rec(
                "batched_decode",
                dtype=dname,
                batch=len(lengths),
                pass_q_steps=pass_q,
                tokens_equal=torch.equal(out.sequences, out_ref.sequences),
                ranks_agree=gathered_equal(out.sequences),
                spread=per_sequence_spread(out.past_key_values, len(lengths)),
            )
        if dtype == torch.float64 and REGISTRY[family].indexed:
            rec("prefill_logits", dtype=dname, length=97, tied=True, max_diff=_tied_prefill(family))
        if dtype == torch.float64:
            # beam search reorders the sharded cache; hidden states come back gathered in order
            ids = prompt(41, seed=41, batch=2)
            b_ref = ref.generate(ids, num_beams=3, max_new_tokens=12, do_sample=False, early_stopping=False)
            b_cp = cp.generate(ids, num_beams=3, max_new_tokens=12, do_sample=False, early_stopping=False)
            rec("beam_search", dtype=dname, tokens_equal=torch.equal(b_cp, b_ref), ranks_agree=gathered_equal(b_cp))
            h_ref = ref(ids, output_hidden_states=True).hidden_states
            h_cp = cp(ids, output_hidden_states=True).hidden_states
            rec(
                "hidden_states",
                dtype=dname,
                count_equal=len(h_ref) == len(h_cp),
                max_diff=max(logits_diff(a, b) for a, b in zip(h_cp, h_ref)),
            )
            # inputs_embeds instead of input_ids, for a forward and for generate()
            emb = ref.get_input_embeddings()(ids)
            rec(
                "prefill_logits",
                dtype=dname,
                length=-ids.shape[1],
                max_diff=logits_diff(cp(inputs_embeds=emb).logits, ref(inputs_embeds=emb).logits),
            )
            e_ref = ref.generate(inputs_embeds=emb, max_new_tokens=12, do_sample=False)
            e_cp = cp.generate(inputs_embeds=emb, max_new_tokens=12, do_sample=False)
            rec("greedy_embeds", dtype=dname, tokens_equal=torch.equal(e_cp, e_ref), ranks_agree=gathered_equal(e_cp))
        if dtype == torch.float32:
            # seeded sampling: identical on all ranks and equal to the single process
            ids = prompt(45, seed=45)
            torch.manual_seed(123)
            s_ref = ref.generate(ids, max_new_tokens=32, do_sample=True, top_k=0, top_p=1.0, min_new_tokens=32)
            torch.manual_seed(123)
            s_cp = cp.generate(ids, max_new_tokens=32, do_sample=True, top_k=0, top_p=1.0, min_new_tokens=32)
            rec("sampling", dtype=dname, tokens_equal=torch.equal(s_cp, s_ref), ranks_agree=gathered_equal(s_cp))
            # remove_context_parallel restores bit-identical stock behaviour
            hf_contextpar.remove_context_parallel(cp)
            ids = prompt(53, seed=53)
            same = torch.equal(cp(ids).logits, ref(ids).logits)
            g_same = torch.equal(
                cp.generate(ids, max_new_tokens=8, do_sample=False),
                ref.generate(ids, max_new_tokens=8, do_sample=False),
            )
            rec("removed", dtype=dname, bitwise=same and g_same)

    # bf16: the bound is what swapping the attention kernel alone changes on one process
    ref, cp = pair(family, torch.bfloat16)
    ids = prompt(301, seed=301)
    r = ref(ids).logits
    # indexed attention (DSA): bf16 rounding moves the indexer's scores, and a top-k flips where two are that close,
    # which a kernel swap does in later layers only: the bound is bf16's own rounding, as for one kernel
    if impl_for(family) == "sdpa" and not REGISTRY[family].indexed:
        alt = OnRankZero(tiny_model(family, dtype=torch.bfloat16, attn_implementation="eager"))
        kernel_swap = logits_diff(alt(ids).logits, r)
    else:  # only one kernel exists (Gemma2 eager), or DSA: use bf16's own rounding, bf16 vs the fp32 model
        fp32 = OnRankZero(tiny_model(family, dtype=torch.float32, attn_implementation="eager"))
        kernel_swap = logits_diff(fp32(ids).logits, r)
    rec("bf16_prefill", dtype="bfloat16", max_diff=logits_diff(cp(ids).logits, r), kernel_swap=kernel_swap)


def main():
    out_dir, families = sys.argv[1], sys.argv[2].split(",") if len(sys.argv) > 2 else FAMILIES
    torch.set_num_threads(1)
    hf_contextpar.apply_context_parallel(tiny_model("llama"))  # initialises the process group from the env
    n = dist.get_world_size() if dist.is_initialized() else 1
    records = []
    for family in families:
        try:
            run_family(family, n, records)
        except Exception as e:  # recorded, so one broken family does not hide the others
            import traceback

            records.append(dict(family=family, n=n, case="error", error=f"{e}\n{traceback.format_exc()}"))
    write_records(out_dir, records)


if __name__ == "__main__":
    main()
