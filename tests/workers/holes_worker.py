"""One rank of the targeted tests for combinations that once went wrong silently or crashed:
position-dependent RoPE, DynamicCache semantics (crop(0) in assisted / prompt-lookup decoding),
a caller-kept DynamicCache, packed inputs and mask-changing flags, cache_implementation, the
post-generate check, a turn after batched decode, one-token prompts with B >= N, and settings
that differ across ranks. Every case compares with the unpatched model in this process.
Writes OUT/rank{r}.json: one record per case with ok=True/False and details."""

from __future__ import annotations

import torch
import torch.distributed as dist
from cp_worker import gathered_equal, impl_for, left_padded, prompt
from hf_contextpar.eval import logits_diff
from records import run_cases, tolerance
from shared_reference import OnRankZero
from transformers import DynamicCache

import hf_contextpar
from hf_contextpar.cache.sharded import cache_argument, returned_cache
from hf_contextpar.errors import (
    CacheMismatchError,
    ContextParallelError,
    PackedSequenceError,
    RankMismatchError,
    UnsupportedModelError,
)
from hf_contextpar.models import tiny_model

LLAMA_FP64 = tolerance("llama", "float64")  # pair()'s default model: the exactness oracle's bound

ROPES = {
    "dynamic": dict(
        rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0), max_position_embeddings=64
    ),
    "linear": dict(rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=10000.0)),
    "yarn": dict(
        rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=10000.0, original_max_position_embeddings=32)
    ),
    "llama3": dict(
        rope_parameters=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
            rope_theta=500000.0,
        )
    ),
}
LONGROPE = dict(
    rope_parameters=dict(
        rope_type="longrope",
        rope_theta=10000.0,
        short_factor=[1.0 + i / 8 for i in range(8)],
        long_factor=[2.0 + i for i in range(8)],
        original_max_position_embeddings=64,
    ),
    original_max_position_embeddings=64,
    max_position_embeddings=512,
)


def pair(family="llama", dtype=torch.float64, strategy="auto", **kw):
    impl = impl_for(family)
    ref = OnRankZero(tiny_model(family, dtype=dtype, attn_implementation=impl, **kw))
    cp = tiny_model(family, dtype=dtype, attn_implementation=impl, **kw)
    return ref, hf_contextpar.apply_context_parallel(cp, timeout=60, strategy=strategy)


def greedy(model, ids, n=12, **kw):
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)


@torch.no_grad()
def cases(n):
    """Yields (name, check) pairs; check() returns a dict with 'ok'."""

    def rope(name, family, overrides, lengths):
        def check():
            ref, cp = pair(family, **overrides)
            worst, same = 0.0, True
            for length in lengths:
                ids = prompt(length, seed=length)
                worst = max(worst, logits_diff(cp(ids).logits, ref(ids).logits))
                out = greedy(cp, ids, 30)
                same &= torch.equal(out, greedy(ref, ids, 30)) and gathered_equal(out)
            return dict(ok=worst <= tolerance(family, "float64") and same, max_diff=worst, tokens_equal=same)

        return name, check

    for name, overrides in ROPES.items():
        yield rope(f"rope_{name}", "llama", overrides, (50, 101))
    # original 64: a prompt just above it (some shards see only positions below it), one far above,
    # and generation that crosses it (Phi-3 then drops the cache and prefills again)
    yield rope("rope_longrope_phi3", "phi3", LONGROPE, (40, 67, 101))

    def partial_prefill_rope():  # a second turn over the cache crosses max_position_embeddings
        ref, cp = pair("llama", **ROPES["dynamic"])
        ids = prompt(90, seed=3)
        c_ref, c_cp = ref(ids[:, :40]).past_key_values, cp(ids[:, :40]).past_key_values
        d = logits_diff(cp(ids[:, 40:], past_key_values=c_cp).logits, ref(ids[:, 40:], past_key_values=c_ref).logits)
        return dict(ok=d <= LLAMA_FP64, max_diff=d)

    yield "rope_dynamic_partial_prefill", partial_prefill_rope

    def assisted():
        ref, cp = pair()
        helper = tiny_model("llama", dtype=torch.float64)  # identical weights: every draft is accepted
        ids = prompt(37, seed=37)
        want = greedy(ref, ids, 16)
        got = greedy(cp, ids, 16, assistant_model=helper)
        return dict(ok=torch.equal(got, want) and gathered_equal(got))

    yield "assisted_identical_assistant", assisted

    def prompt_lookup():
        ref, cp = pair()
        ids = prompt(23, seed=5).repeat(1, 3)  # repeats give the lookup something to propose
        want = greedy(ref, ids, 16)
        got = greedy(cp, ids, 16, prompt_lookup_num_tokens=3)
        return dict(ok=torch.equal(got, want) and gathered_equal(got))

    yield "prompt_lookup", prompt_lookup

    def dsa_candidates():
        """Indexed attention (DSA): prompt lookup and assisted decoding (drafts rejected: crops of the index keys)
        give one process's tokens; over a filled cache, where transformers feeds the sequence again on top (the
        context twice: fuzz seed 21 case 6), they are refused before any forward."""
        ref, cp = pair("deepseek_v32")
        ids, ok = prompt(19, seed=5).repeat(1, 2), True
        for extra in (dict(prompt_lookup_num_tokens=3), dict(assistant_model=tiny_model("llama", torch.float64, 1))):
            got = greedy(cp, ids, 6, **extra)
            ok &= torch.equal(got, greedy(ref, ids, 6, **extra)) and gathered_equal(got)
        first = cp.generate(ids[:, :7], max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
        try:
            more = torch.cat([first.sequences, ids[:, :2]], 1)
            greedy(cp, more, 4, prompt_lookup_num_tokens=3, past_key_values=returned_cache(first))
            refused = False
        except CacheMismatchError:
            refused = True
        return dict(ok=ok and refused, tokens_equal=ok, refused_over_filled_cache=refused)

    yield "dsa_candidate_decoding", dsa_candidates

    def crop_semantics():
        _, cp = pair()
        cache = cp(prompt(29, seed=1)).past_key_values
        cache.crop(0)
        kept = cache.get_seq_length()
        cache.crop(-4)
        try:
            cache.crop(10)
            positive = "accepted"
        except ValueError:
            positive = "refused"
        return dict(
            ok=kept == 29 and cache.get_seq_length() == 25 and positive == "refused", kept=kept, positive=positive
        )

    yield "crop_like_dynamic_cache", crop_semantics

    def cache_names():
        """transformers 5.24 renamed past_key_values to cache, keeping the old name as an alias (given
        both, cache wins, even when it is None); before 5.24 a cache= keyword is ignored. Whatever the
        unpatched model makes of the names, the patched one makes the same."""
        ref, cp = pair()
        ids = prompt(70, seed=13)
        variants = {
            "cache": lambda c: dict(cache=c),
            "past_key_values": lambda c: dict(past_key_values=c),
            "both": lambda c: dict(cache=c, past_key_values=DynamicCache()),
            "cache_none": lambda c: dict(cache=None, past_key_values=c),
        }
        diffs = {}
        for name, kw in variants.items():
            first = [returned_cache(m(ids[:, :40])) for m in (cp, ref)]
            second = [m(ids[:, 40:], **kw(c)).logits for m, c in zip((cp, ref), first)]
            diffs[name] = logits_diff(*second)
        return dict(ok=max(diffs.values()) <= LLAMA_FP64, cache_argument=cache_argument(cp), diffs=diffs)

    yield "cache_argument_names", cache_names

    def in_place_cache():
        ref, cp = pair()
        ids = prompt(60, seed=11)
        mine, theirs = DynamicCache(), DynamicCache()
        cp(ids[:, :35], past_key_values=mine)
        ref(ids[:, :35], past_key_values=theirs)
        d = logits_diff(cp(ids[:, 35:], past_key_values=mine).logits, ref(ids[:, 35:], past_key_values=theirs).logits)
        # and generate() twice with the caller's cache object, the second call continuing the first
        mine, theirs = DynamicCache(), DynamicCache()
        a = greedy(cp, ids[:, :30], 6, past_key_values=mine)
        b = greedy(ref, ids[:, :30], 6, past_key_values=theirs)
        a2 = greedy(cp, torch.cat([a, ids[:, 30:40]], 1), 6, past_key_values=mine)
        b2 = greedy(ref, torch.cat([b, ids[:, 30:40]], 1), 6, past_key_values=theirs)
        return dict(
            # the reference ran on rank 0 alone (OnRankZero): its cache held every token but the last generated one
            ok=d <= LLAMA_FP64 and torch.equal(a2, b2) and mine.get_seq_length() == b2.shape[1] - 1,
            max_diff=d,
            length=mine.get_seq_length(),
        )

    yield "caller_kept_dynamic_cache", in_place_cache

    def sliding_cache_keeps_its_window():
        """Sliding layers keep what one process keeps (the last window - 1 columns), spread over the
        ranks, through prefill, replicated and batched decode, a returned cache and a second turn."""
        window = 6
        kw = dict(sliding_window=window, layer_types=["sliding_attention", "full_attention"])
        ref, cp = pair("qwen2", **kw)
        report, ok = {}, True
        for batch in (1, n + 1):  # replicated decode; batched ring pass-Q decode (per-sequence tables)
            ids, mask = left_padded([41 - 3 * b for b in range(batch)], seed=batch)
            run = dict(max_new_tokens=9, do_sample=False, return_dict_in_generate=True)
            a, b = cp.generate(ids, attention_mask=mask, **run), ref.generate(ids, attention_mask=mask, **run)
            ok &= torch.equal(a.sequences, b.sequences) and gathered_equal(a.sequences)
            # a second turn over the returned (trimmed) caches
            more = torch.randint(0, 256, (batch, 7), generator=torch.Generator().manual_seed(9))
            ids2 = torch.cat([a.sequences, more], 1)
            mask2 = torch.cat([mask, torch.ones(batch, ids2.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
            a2 = cp.generate(ids2, attention_mask=mask2, past_key_values=a.past_key_values, **run)
            b2 = ref.generate(ids2, attention_mask=mask2, past_key_values=b.past_key_values, **run)
            ok &= torch.equal(a2.sequences, b2.sequences)
            cache, one = a2.past_key_values, b2.past_key_values
            held = torch.tensor([cache.layers[0].live, cache.layers[1].live])
            everyone = [torch.empty_like(held) for _ in range(dist.get_world_size())]
            dist.all_gather(everyone, held)
            sliding = [int(e[0]) for e in everyone]
            single = one.layers[0].keys.shape[2]  # what the one-process sliding layer keeps: window - 1
            full = sum(int(e[1]) for e in everyone)
            # every kept column on exactly one rank (1D layouts); per-sequence tables may keep a few more
            exact = batch == 1  # per-sequence tables (batched decode) hold a few empty slots too
            ok &= single == window - 1
            ok &= full == one.layers[1].keys.shape[2] if exact else full <= one.layers[1].keys.shape[2] + n * batch
            ok &= sum(sliding) == single if exact else sum(sliding) <= single + n * batch
            report[f"batch{batch}"] = dict(sliding_per_rank=sliding, single=single, full=full, ok=bool(ok))
        return dict(ok=bool(ok), **report)

    yield "sliding_cache_keeps_its_window", sliding_cache_keeps_its_window

    def differing_sliding_trim_refused():
        """crop(0) while recording the past trims the sliding layers; a rank that skipped it would send
        sliding-layer blocks of other sizes in the next prefill: the input check refuses that first."""
        _, cp = pair("qwen2", sliding_window=6, layer_types=["sliding_attention", "full_attention"])
        ids = prompt(40, seed=4)
        cache = cp(ids[:, :30], past_key_values=DynamicCache(config=cp.config)).past_key_values
        cache.activate_past_recording()
        cp(ids[:, 30:33], past_key_values=cache)
        if dist.get_rank() == 0:
            cache.crop(0)
        try:
            cp(ids[:, 33:], past_key_values=cache)
            return dict(ok=False, error="ranks with different sliding layers went undetected")
        except ContextParallelError as e:
            return dict(ok=isinstance(e, RankMismatchError), error=str(e)[:200])

    yield "differing_sliding_trim_refused", differing_sliding_trim_refused

    def packed():
        _, cp = pair()
        ids = prompt(30, seed=2)
        pos = torch.cat([torch.arange(12), torch.arange(18)]).unsqueeze(0)
        try:
            cp(ids, position_ids=pos, use_cache=False)
            return dict(ok=False, error="accepted packed position_ids")
        except ContextParallelError as e:
            return dict(ok=isinstance(e, PackedSequenceError))

    yield "packed_position_ids_refused", packed

    def bidirectional():
        try:
            pair("gemma3_text", use_bidirectional_attention=True)
            return dict(ok=False, error="accepted")
        except UnsupportedModelError as e:
            return dict(ok=type(e) is UnsupportedModelError and "bidirectional" in str(e))

    yield "bidirectional_refused", bidirectional

    def cache_implementations():
        ref, cp = pair()
        ids = prompt(21, seed=21)
        results = {}
        for impl in ("static", "offloaded", "dynamic"):
            try:
                got = greedy(cp, ids, 4, cache_implementation=impl)
                results[impl] = "exact" if torch.equal(got, greedy(ref, ids, 4, cache_implementation=impl)) else "WRONG"
            except CacheMismatchError:
                results[impl] = "error"
        return dict(ok=results == dict(static="error", offloaded="error", dynamic="exact"), results=results)

    yield "cache_implementation", cache_implementations

    def last_step_rng():
        _, cp = pair()
        torch.manual_seed(dist.get_rank())  # differing RNG: only the final sampled token differs
        try:
            cp.generate(prompt(9, seed=9), max_new_tokens=1, do_sample=True, top_k=0)
            return dict(ok=False, error="differing sequences went undetected")
        except ContextParallelError as e:
            return dict(ok=isinstance(e, RankMismatchError))

    yield "differing_last_sample_detected", last_step_rng

    strategies = ["ring_pass_kv", "ring_pass_q", "allgather_kv", "kv_runahead", "auto"] + (
        ["ulysses"] if 2 % n == 0 else []
    )
    for strategy in strategies:

        def turn_after_batched_decode(strategy=strategy):
            ref, cp = pair(strategy=strategy)
            ids, mask = left_padded([31, 17, 25, 40, 12][: n + 1], seed=n)
            out_ref = ref.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=6,
                min_new_tokens=6,
                do_sample=False,
                return_dict_in_generate=True,
            )
            out = cp.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=6,
                min_new_tokens=6,
                do_sample=False,
                return_dict_in_generate=True,
            )
            batched = hf_contextpar.get_runtime(cp).algorithm_counts["ring_pass_q_decode"]
            follow = prompt(2 * n + 3, seed=77, batch=n + 1)
            seq = torch.cat([out.sequences, follow], 1)
            m = torch.cat([mask, torch.ones(n + 1, 6 + follow.shape[1], dtype=mask.dtype)], 1)
            got = cp.generate(
                seq,
                attention_mask=m,
                past_key_values=out.past_key_values,
                max_new_tokens=6,
                min_new_tokens=6,
                do_sample=False,
            )
            want = ref.generate(
                seq,
                attention_mask=m,
                past_key_values=out_ref.past_key_values,
                max_new_tokens=6,
                min_new_tokens=6,
                do_sample=False,
            )
            return dict(ok=batched > 0 and torch.equal(got, want) and gathered_equal(got), batched_steps=batched)

        yield f"turn_after_batched_decode_{strategy}", turn_after_batched_decode

    def one_token_batch():
        ref, cp = pair()
        x = prompt(1, seed=4, batch=n)
        d = logits_diff(cp(x).logits, ref(x).logits)
        beams = torch.equal(
            cp.generate(x[:1], num_beams=n, max_new_tokens=6, do_sample=False),
            ref.generate(x[:1], num_beams=n, max_new_tokens=6, do_sample=False),
        )
        torch.manual_seed(5)
        s_cp = cp.generate(x[:1], do_sample=True, num_return_sequences=n, max_new_tokens=6)
        torch.manual_seed(5)
        s_ref = ref.generate(x[:1], do_sample=True, num_return_sequences=n, max_new_tokens=6)
        return dict(ok=d <= LLAMA_FP64 and beams and torch.equal(s_cp, s_ref), max_diff=d, beams=beams)

    yield "one_token_prompt_batch_ge_n", one_token_batch

    def differing_settings():
        model = tiny_model("llama", dtype=torch.float64)
        try:
            hf_contextpar.apply_context_parallel(
                model, timeout=60, strategy="ring_pass_q" if dist.get_rank() else "ring_pass_kv"
            )
            return dict(ok=False, error="accepted")
        except ContextParallelError as e:
            return dict(ok=isinstance(e, RankMismatchError))

    yield "differing_strategy_refused", differing_settings

    def differing_calibration():
        # rank 0 calibrated a machine where pass-Q always wins; the others have the defaults (pass-KV)
        cal = dict(attn_flops=1e18, bandwidth=1.0) if dist.get_rank() == 0 else None
        ref = tiny_model("llama", dtype=torch.float64)
        cp = hf_contextpar.apply_context_parallel(tiny_model("llama", dtype=torch.float64), timeout=60, calibration=cal)
        ids = prompt(50, seed=50)
        cache = cp(ids[:, :40]).past_key_values
        c_ref = ref(ids[:, :40]).past_key_values
        d = logits_diff(cp(ids[:, 40:], past_key_values=cache).logits, ref(ids[:, 40:], past_key_values=c_ref).logits)
        algorithm = hf_contextpar.get_runtime(cp).last_forward["algorithm"]
        return dict(ok=d <= LLAMA_FP64 and algorithm == "ring_pass_q", algorithm=algorithm, max_diff=d)

    yield "calibration_from_rank0", differing_calibration


if __name__ == "__main__":
    run_cases(cases)
