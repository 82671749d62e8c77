"""One rank of the hybrid matrix (issue 30): for every family of tests/workers/hybrids.py, the patched model
against the unpatched one on this process, fp64 with the models' fp32 internals in fp64: a padded,
uneven prompt's logits and the K/V each rank keeps (an even share, uneven partitions too); a second
turn over the cache (chained); a third shorter than 2 tokens per rank (every rank runs it), and
decode after a prompt that short; a forward without a cache; greedy, beam-search and sampled
generation from the padded batch; fp32 greedy. Writes OUT/rank{r}.json. argv: OUT [families] [strategy]."""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist
from cp_worker import gathered_equal  # noqa: E402
from hf_contextpar.eval.oracle import Fp64Internals  # noqa: E402
from hf_contextpar.patches import REGISTRY  # noqa: E402
from hf_contextpar.patches.mamba1 import MaskedInput  # noqa: E402
from hybrids import BEAMS_REFUSED, FAMILIES, GIVEN_CACHE, STATE_LIST, hybrid_model  # noqa: E402
from records import record_each  # noqa: E402
from shared_reference import OnRankZero
from transformers import DynamicCache

import hf_contextpar  # noqa: E402
from hf_contextpar.cache.sharded import returned_cache  # noqa: E402
from hf_contextpar.plan.partitions import even  # noqa: E402


def diff(a, b, rows=None) -> float:
    d = (a - b).abs().amax(-1)
    return float((d[rows] if rows is not None else d).max())


def _uneven(strategy: str, n: int) -> tuple[str, dict]:
    """(strategy, apply's extra arguments): "uneven" is KV-Runahead over uneven partitions from a table, the first rank
    taking the most."""
    if strategy != "uneven":
        return strategy, {}
    ratios = [2.0**-r for r in range(n)]
    return "kv_runahead", dict(partitions=dict(world=n, entries={"8": [x / sum(ratios) for x in ratios]}))


def _refused(run, error=hf_contextpar.UnsupportedInputError) -> bool:
    try:
        run()
    except error:
        return True
    return False


@torch.no_grad()
def check_state_list(family: str, n: int, strategy: str, rec):
    """A model whose states are a list of its own, passed back as `state=` (RWKV's, patches/rwkv.py): an uneven
    prompt's logits and final states; a second turn from the returned list (as its own tests continue), which the
    patched model fills in place as one process does; a prompt of 2 tokens per rank (the shortest chained
    partitions), one under 2 per rank (every rank runs it: 5 tokens at N = 4) and a decode step from its list; no
    cache; greedy, sampled and fp32 generation and generate's second turn from its list; padding, batched one-token
    steps and beam search refused (one process ignores the mask, mixes a batch's rows in a one-token step and does not
    reorder the list with the beams); a list of another batch refused on every rank."""
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(3, 250, (2, 6 * n + 5), generator=g)
    more = torch.randint(3, 250, (2, 2 * n + 1), generator=g)
    ref, cp = OnRankZero(hybrid_model(family)), hybrid_model(family)
    strategy, extra = _uneven(strategy, n)
    hf_contextpar.apply_context_parallel(cp, strategy=strategy, timeout=120, **extra)
    outs = []
    for model in (ref, cp):
        first = model(ids)
        kept = [t.clone() for t in first.state]
        second = model(more, state=first.state)
        short = model(ids[:1, : n + 1])
        step = model(more[:1, :1], state=short.state)
        pairs = model(ids[:, : 2 * n])
        plain = model(ids, use_cache=False)
        outs.append((first.logits, kept, second, step.logits, pairs.logits, plain))
    (a1, sa, a2, a3, a4, ap), (b1, sb, b2, b3, b4, bp) = outs
    rec("prefill", max_diff=max([diff(a1, b1)] + [diff(x, y) for x, y in zip(sa, sb)]))
    states = max(diff(x, y) for x, y in zip(a2.state, b2.state))
    rec("second_turn", max_diff=max(diff(a2.logits, b2.logits), states), in_place=b2.state is outs[1][2].state)
    rec("short_then_step", max_diff=diff(a3, b3))
    rec("pairs", max_diff=diff(a4, b4))
    rec("no_cache", max_diff=diff(ap.logits, bp.logits), cache_none=bp.state is None)
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    a, b = ref.generate(ids[:1], **kw), cp.generate(ids[:1], **kw)
    rec("greedy", max_diff=max(diff(x, y) for x, y in zip(a.logits, b.logits)))
    rec("greedy_tokens", tokens_equal=torch.equal(a.sequences, b.sequences), ranks_agree=gathered_equal(b.sequences))
    turn = torch.cat([a.sequences[:, -1:], more[:1]], 1)  # the tokens its list has not seen
    a, b = ref.generate(turn, state=a.past_key_values, **kw), cp.generate(turn, state=b.past_key_values, **kw)
    rec("generate_turn", max_diff=max(diff(x, y) for x, y in zip(a.logits, b.logits)))
    padded = torch.ones_like(ids)
    padded[1, :3] = 0
    rec("padding_refused", refused=_refused(lambda: cp(ids, attention_mask=padded)))
    rec("batched_step_refused", refused=_refused(lambda: cp(more[:, :1], state=[t.clone() for t in sb])))
    rec("beams_refused", refused=_refused(lambda: cp.generate(ids[:1], num_beams=2, max_new_tokens=3)))
    # a list of another batch (one sequence's, for two): one process fails in a block; only rank 0 reads the caller's
    # list in a prefill, so the refusal must come before any rank runs one, or rank 0 fails while the others wait
    one = [t.clone() for t in short.state]
    rec("mismatched_state_refused", refused=_refused(lambda: cp(ids, state=one), hf_contextpar.CacheMismatchError))
    torch.manual_seed(5)
    a = ref.generate(ids[:1], max_new_tokens=5, do_sample=True, top_k=20)
    torch.manual_seed(5)
    b = cp.generate(ids[:1], max_new_tokens=5, do_sample=True, top_k=20)
    rec("sample", tokens_equal=torch.equal(a, b), ranks_agree=gathered_equal(b))
    ref, cp = ref.float(), cp.float()
    a, b = (
        ref.generate(ids[:1], max_new_tokens=5, do_sample=False),
        cp.generate(ids[:1], max_new_tokens=5, do_sample=False),
    )
    rec("greedy_fp32", tokens_equal=torch.equal(a, b), ranks_agree=gathered_equal(b))


@torch.no_grad()
def check(family: str, n: int, strategy: str, rec):
    if family in STATE_LIST:
        return check_state_list(family, n, strategy, rec)
    g = torch.Generator().manual_seed(n)
    length = 6 * n + 5  # uneven at every N
    ids = torch.randint(3, 250, (2, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, : 2 * n + 3] = 0  # row 1's padding reaches past the first partition
    more = torch.randint(3, 250, (2, 2 * n + 1), generator=g)
    last = torch.randint(3, 250, (2, 2 * n - 1), generator=g)  # < 2 tokens per rank: every rank runs it
    ref, cp = OnRankZero(hybrid_model(family)), hybrid_model(family)
    # Mamba1's models take the new tokens' mask alone (one column per input token)
    raw = isinstance(REGISTRY[family].hooks, MaskedInput)
    strategy, extra = _uneven(strategy, n)
    hf_contextpar.apply_context_parallel(cp, strategy=strategy, timeout=120, **extra)
    with Fp64Internals():
        outs = []
        for model in (ref, cp):
            # a stateful model (RecurrentGemma's) returns no cache: it runs with the one the caller keeps and passes
            given = DynamicCache(config=model.config) if family in GIVEN_CACHE else None
            first = model(ids, attention_mask=mask, **({} if given is None else dict(cache=given)))
            cache = returned_cache(first) or given
            held = cache.local_length if model is cp else None  # K/V tokens kept on this rank
            m2 = torch.cat([mask, torch.ones_like(more)], 1)
            second = model(more, attention_mask=m2[:, -more.shape[1] :] if raw else m2, cache=cache)
            cache = returned_cache(second) or given
            held2 = cache.local_length if model is cp else None
            m3 = torch.cat([m2, torch.ones_like(last)], 1)
            third = model(last, attention_mask=m3[:, -last.shape[1] :] if raw else m3, cache=cache)
            plain = model(ids, attention_mask=mask, use_cache=False)
            outs.append((first.logits, second.logits, third.logits, plain))
        (a1, a2, a3, ap), (b1, b2, b3, bp) = outs
        rec("prefill", max_diff=diff(a1, b1, mask.bool()), kv_tokens=held, even=even(length, n)[dist.get_rank()])
        shares = even(more.shape[1], n)[dist.get_rank()] + even(length, n)[dist.get_rank()]
        rec("second_turn", max_diff=diff(a2, b2), kv_tokens=held2, even=shares)
        rec("short_turn", max_diff=diff(a3, b3))
        rec("no_cache", max_diff=diff(ap.logits, bp.logits, mask.bool()), cache_none=returned_cache(bp) is None)
        kw = dict(attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False)
        a, b = ref.generate(ids, **kw), cp.generate(ids, **kw)
        rec("greedy", tokens_equal=torch.equal(a, b), ranks_agree=gathered_equal(b))
        # a prompt under 2 tokens per rank (every rank runs it, unchained), then decode from its states
        short = dict(
            max_new_tokens=4, min_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        a, b = ref.generate(ids[:1, -(2 * n - 1) :], **short), cp.generate(ids[:1, -(2 * n - 1) :], **short)
        rec("short_prompt", max_diff=max(diff(x, y) for x, y in zip(a.logits, b.logits)))
        kw.update(num_beams=2, max_new_tokens=4, min_new_tokens=4)  # reorder_cache over the states and the shards
        if family in BEAMS_REFUSED:
            try:
                cp.generate(ids, **kw)
                rec("beams", refused=False)
            except hf_contextpar.UnsupportedInputError:
                rec("beams", refused=True)
        else:
            a, b = ref.generate(ids, **kw), cp.generate(ids, **kw)
            rec("beams", tokens_equal=torch.equal(a, b), ranks_agree=gathered_equal(b))
        kw.update(num_beams=1, do_sample=True, top_k=20)
        torch.manual_seed(5)
        a = ref.generate(ids, **kw)
        torch.manual_seed(5)
        b = cp.generate(ids, **kw)
        rec("sample", tokens_equal=torch.equal(a, b), ranks_agree=gathered_equal(b))
    ref, cp = ref.float(), cp.float()
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False)
    a, b = ref.generate(ids[:1], **kw), cp.generate(ids[:1], **kw)
    rec("greedy_fp32", tokens_equal=torch.equal(a, b), ranks_agree=gathered_equal(b))


def main():
    out_dir = sys.argv[1]
    families = sys.argv[2].split(",") if len(sys.argv) > 2 and sys.argv[2] else FAMILIES
    strategy = sys.argv[3] if len(sys.argv) > 3 else "auto"
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    record_each(out_dir, families, "family", lambda family, rec: check(family, dist.get_world_size(), strategy, rec))


if __name__ == "__main__":
    main()
