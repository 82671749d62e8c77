"""One rank of the KV-interleave matrix (issue 13): decode K/V stored in runs of k tokens per rank
(`apply_context_parallel(kv_interleave=k)`), against the unpatched single-process model.

For every k, decode mode and batch (one sequence, a left-padded pair, a left-padded batch of N + 1
so that batched ring pass-Q decode runs on every N): a greedy turn, a second turn over the kept
cache (a partial prefill of 7 tokens, then decode) and a third of one token (T < N: the replicated
path, continuing the open run), comparing every step's logits and the tokens. Assisted and
prompt-lookup decoding (which crop the cache after rejected drafts) run on one sequence. A
decode mode the batch cannot run (ring_pass_q below N sequences) must raise its clear error.
Writes OUT/rank{r}.json: one record per case with ok=True/False and details."""

from __future__ import annotations

import torch
from cp_worker import gathered_equal, left_padded, per_sequence_spread, prompt
from hf_contextpar.eval import logits_diff
from records import run_cases, tolerance
from shared_reference import OnRankZero

import hf_contextpar
from hf_contextpar.errors import ContextParallelError, DecodeBatchError
from hf_contextpar.models import tiny_model

KS = (1, 2, 3, 16)
DECODES = ("auto", "replicated", "ring_pass_q")
TURNS = ((None, 20), (7, 20), (1, 6))  # (tokens appended before the turn, tokens generated)


def batches(n):
    return {"B1": [29], "B2_padded": [29, 18], f"B{n + 1}_padded": [29, 18, 33, 21][: n + 1]}


def greedy(model, ids, mask, cache, new):
    return model.generate(
        ids,
        attention_mask=mask,
        past_key_values=cache,
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )


def conversation(ref, cp, lengths, k):
    """Three turns on both models; the worst logit difference, tokens equal, the widest per-sequence spread."""
    ids, mask = left_padded(lengths, seed=sum(lengths))
    g = torch.Generator().manual_seed(k)
    c_ref = c_cp = None
    worst, same, agree, spread = 0.0, True, True, 0
    for chunk, new in TURNS:
        if chunk is not None:
            more = torch.randint(0, 256, (ids.shape[0], chunk), generator=g)
            ids, mask = torch.cat([ids, more], 1), torch.cat([mask, torch.ones_like(more)], 1)
        a, b = greedy(ref, ids, mask, c_ref, new), greedy(cp, ids, mask, c_cp, new)
        worst = max([worst] + [logits_diff(y, x) for x, y in zip(a.logits, b.logits)])
        same &= torch.equal(a.sequences, b.sequences)
        agree &= gathered_equal(b.sequences)
        c_ref, c_cp = a.past_key_values, b.past_key_values
        spread = max(spread, per_sequence_spread(c_cp, len(lengths)))
        ids = a.sequences
        mask = torch.cat([mask, torch.ones(ids.shape[0], ids.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
    return worst, same, agree, spread


@torch.no_grad()
def cases(n):
    tol = tolerance("llama", "float32")
    for k in KS:
        for decode in DECODES:
            for name, lengths in batches(n).items():

                def check(k=k, decode=decode, lengths=lengths):
                    ref = OnRankZero(tiny_model("llama"))
                    cp = hf_contextpar.apply_context_parallel(
                        tiny_model("llama"), decode=decode, kv_interleave=k, timeout=60
                    )
                    runtime = hf_contextpar.get_runtime(cp)
                    try:
                        worst, same, agree, spread = conversation(ref, cp, lengths, k)
                    except ContextParallelError as e:
                        refused = decode == "ring_pass_q" and len(lengths) < n
                        return dict(ok=refused and isinstance(e, DecodeBatchError), error=str(e)[:200])
                    finally:
                        hf_contextpar.remove_context_parallel(cp)
                    batched = runtime.algorithm_counts["ring_pass_q_decode"]
                    # batched decode keeps per-sequence tables, and a partial prefill over them can leave
                    # one sequence a token further apart (as with k = 1)
                    bound = k + (batched > 0)
                    ok = worst <= tol and same and agree and spread <= bound
                    ok &= decode != "ring_pass_q" or len(lengths) >= n  # below N sequences it must raise
                    return dict(ok=ok, max_diff=worst, tokens_equal=same, spread=spread, batched_steps=batched)

                yield f"k{k}-{decode}-{name}", check

        for mode in ("assisted", "lookup"):

            def drafts(k=k, mode=mode):
                ref = OnRankZero(tiny_model("llama"))
                cp = hf_contextpar.apply_context_parallel(tiny_model("llama"), kv_interleave=k, timeout=60)
                ids = prompt(23, seed=5).repeat(1, 2)  # repeats give the lookup something to propose
                # an assistant with other weights: drafts get rejected, so the cache is cropped
                extra = (
                    dict(assistant_model=tiny_model("llama", seed=1))
                    if mode == "assisted"
                    else dict(prompt_lookup_num_tokens=3)
                )
                want = ref.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
                got = cp.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, **extra)
                hf_contextpar.remove_context_parallel(cp)
                return dict(ok=torch.equal(got, want) and gathered_equal(got))

            yield f"k{k}-{mode}", drafts


if __name__ == "__main__":
    run_cases(cases)
