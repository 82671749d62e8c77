"""Single-process unit tests: sharding, merge, the local LSE kernel, input validation."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from hf_contextpar.attention.kernels import _math, attend
from hf_contextpar.attention.merge import (
    Accumulator,
    merge_packed,
    merge_packed_out,
    merge_pair,
    merge_stacked,
    pack_partial,
    with_sink,
)
from hf_contextpar.plan.sharding import decode_owners, head_tail_plan


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("t", [0, 1, 2, 3, 7, 8, 9, 17, 64, 301])
def test_head_tail_covers_and_balances(n, t):
    plan = head_tail_plan(t, n)
    allidx = torch.cat(plan).sort().values
    assert torch.equal(allidx, torch.arange(t))
    sizes = [p.numel() for p in plan]
    assert max(sizes) - min(sizes) <= 1 and max(sizes) == math.ceil(t / n)
    for p in plan:
        assert torch.equal(p, p.sort().values)
    if n > 1 and t >= 4 * n:  # rank 0 holds the first and the last chunk
        assert plan[0][0] == 0 and plan[0][-1] == t - 1


def test_head_tail_keeps_shards_even_over_turns():
    counts = [0, 0, 0]
    for t in [5, 7, 1, 2, 11, 4, 300, 3]:
        plan = head_tail_plan(t, 3, counts)
        assert sorted(torch.cat(plan).tolist()) == list(range(t))
        counts = [c + p.numel() for c, p in zip(counts, plan)]
        assert max(counts) - min(counts) <= 1, counts


def test_least_loaded_evens_out_and_round_robins():
    owned, _ = decode_owners(7, [5, 4, 5])
    counts = [5 + len(owned[0]), 4 + len(owned[1]), 5 + len(owned[2])]
    assert max(counts) - min(counts) <= 1
    assert owned[1][0] == 0  # the short shard gets the first token
    assert sorted(torch.cat(owned).tolist()) == list(range(7))


def _reference(q, k, v, qc, kc, valid, window, scale, softcap):
    vis = kc[None, :] <= qc[:, None]
    if window:
        vis &= (qc[:, None] - kc[None, :]) < window
    vis = vis[None, None]
    if valid is not None:
        vis = vis & valid[:, None, None, :]
    return _math(q.double(), k.double(), v.double(), vis, scale, softcap)


COLS = [
    (torch.cat([torch.arange(0, 5), torch.arange(15, 20)]), torch.cat([torch.arange(5, 10), torch.arange(10, 15)])),
    (torch.cat([torch.arange(0, 5), torch.arange(15, 20)]), torch.cat([torch.arange(0, 5), torch.arange(15, 20)])),
    (torch.arange(20, 21), torch.tensor([0, 1, 2, 5, 7, 9, 11, 20])),
    (torch.arange(3, 9), torch.arange(0, 12)),
    (torch.arange(0, 4), torch.arange(10, 14)),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("cols", range(len(COLS)))
@pytest.mark.parametrize("window,padded,softcap", list(itertools.product([None, 4], [False, True], [None, 5.0])))
def test_attend_matches_math(dtype, cols, window, padded, softcap):
    torch.manual_seed(cols)
    qc, kc = COLS[cols]
    b = 2
    q = torch.randn(b, 4, len(qc), 8, dtype=dtype)
    k, v = torch.randn(b, 2, len(kc), 8, dtype=dtype), torch.randn(b, 2, len(kc), 8, dtype=dtype)
    valid = torch.rand(b, len(kc)) > 0.3 if padded else None
    got = attend(q, k, v, qc, kc, scale=0.3, key_valid=valid, window=window, softcap=softcap)
    out, lse = _reference(q, k, v, qc, kc, valid, window, 0.3, softcap)
    if got is None:
        assert torch.isneginf(lse).all()
        return
    seen = ~torch.isneginf(lse)
    assert torch.equal(torch.isneginf(got[1]), ~seen)
    assert (got[0][~seen] == 0).all()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert (got[0].double() - out)[seen].abs().max() < tol
    assert (got[1].double() - lse)[seen].abs().max() < tol


def test_merge_of_key_splits_is_exact():
    torch.manual_seed(0)
    q = torch.randn(1, 2, 6, 8, dtype=torch.float64)
    k, v = torch.randn(1, 2, 30, 8, dtype=torch.float64), torch.randn(1, 2, 30, 8, dtype=torch.float64)
    full = _math(q, k, v, None, 0.5, None)
    parts = [_math(q, k[:, :, a:b], v[:, :, a:b], None, 0.5, None) for a, b in [(0, 7), (7, 19), (19, 30)]]
    acc = Accumulator()
    for p in parts:
        acc.add(*p)
    assert (acc.out - full[0]).abs().max() < 1e-13 and (acc.lse - full[1]).abs().max() < 1e-13
    out, lse = merge_stacked(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    assert (out - full[0]).abs().max() < 1e-13 and (lse - full[1]).abs().max() < 1e-13


@pytest.mark.parametrize("seed", range(40))
def test_accumulator_merges_partials_over_row_ranges(seed):
    """Partials over any row ranges merge as if each were padded to every row with (0, -inf);
    rows no partial reached read (0, -inf); the caller's partials are never written."""
    gen = torch.Generator().manual_seed(seed)
    rows = int(torch.randint(1, 12, (1,), generator=gen))
    acc = Accumulator(rows)
    want = torch.zeros(1, 2, rows, 3, dtype=torch.float64), torch.full((1, 2, rows), -math.inf, dtype=torch.float64)
    given = []
    for _ in range(int(torch.randint(0, 6, (1,), generator=gen))):
        a, b = sorted(torch.randint(0, rows + 1, (2,), generator=gen).tolist())
        a, b = (0, rows) if a == b else (a, b)  # an empty draw stands for a whole-block partial
        out, lse = (
            torch.randn(1, 2, b - a, 3, generator=gen, dtype=torch.float64),
            torch.randn(1, 2, b - a, generator=gen),
        )
        given.append((out, lse.double(), out.clone(), lse.double().clone()))
        acc.add(given[-1][0], given[-1][1], a)
        padded = torch.zeros_like(want[0]), torch.full_like(want[1], -math.inf)
        padded[0][..., a:b, :], padded[1][..., a:b] = out, lse
        want = merge_pair(*want, *padded)
    got = acc.result()
    if got is None:
        assert not given
        return
    assert (got[0] - want[0]).abs().max() < 1e-13
    assert torch.equal(torch.isneginf(got[1]), torch.isneginf(want[1]))
    seen = ~torch.isneginf(want[1])
    assert (got[1] - want[1])[seen].abs().max() < 1e-13 and (got[0][~seen] == 0).all()
    assert all(torch.equal(o, o0) and torch.equal(lse, lse0) for o, lse, o0, lse0 in given)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_decode_merge_equals_the_full_merge(dtype):
    """merge_packed_out (decode's softmax weights) gives merge_packed's output, rows that no rank saw
    (every LSE -inf) and ranks with nothing visible (a None partial) included."""
    gen = torch.Generator().manual_seed(0)
    parts = []
    for r in range(4):
        out, lse = (
            torch.randn(2, 3, 5, 8, generator=gen, dtype=dtype),
            4 * torch.randn(2, 3, 5, generator=gen, dtype=dtype),
        )
        lse[0, :, 1] = -math.inf  # row 1 of sequence 0: no key on any rank
        lse[1, 0, r] = -math.inf  # one row that this rank does not see
        parts.append(pack_partial((out, lse) if r != 2 else None, (2, 3, 5, 8), dtype, "cpu"))
    stacked = torch.stack(parts)
    want, _ = merge_packed(stacked)
    got = merge_packed_out(stacked)
    assert not got.isnan().any() and (got[0, :, 1] == 0).all()
    assert (got - want).abs().max() < (1e-13 if dtype == torch.float64 else 1e-6)


def _softmax_with_sink(q, k, v, scale, sink):
    """gpt-oss's eager attention: the sink is one more logit per head (Inkling 2's: per query token and head),
    dropped after the softmax."""
    logits = q @ k.transpose(-1, -2) * scale
    sink = sink.view(1, -1, 1, 1) if sink.dim() == 1 else sink[..., None]
    logits = torch.cat([logits, sink.expand(*logits.shape[:-1], 1)], -1)
    return torch.softmax(logits, -1)[..., :-1] @ v


@pytest.mark.parametrize("per_query", [False, True])
def test_sinks_enter_the_merge_once(per_query):
    """Attention with sinks = the merged attention over key splits, then `with_sink`; and decode's
    merge with the sink as one more partial. A row no split saw stays 0 (the sink takes it all). Sinks per head
    (gpt-oss) or per query token and head (Inkling 2's, (B, H, Tq))."""
    torch.manual_seed(1)
    q = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    k, v = torch.randn(2, 3, 24, 8, dtype=torch.float64), torch.randn(2, 3, 24, 8, dtype=torch.float64)
    sink = torch.tensor([0.5, -2.0, 3.0], dtype=torch.float64)
    if per_query:
        sink = 2 * torch.randn(2, 3, 5, dtype=torch.float64)
    want = _softmax_with_sink(q, k, v, 0.5, sink)
    parts = [_math(q, k[..., a:b, :], v[..., a:b, :], None, 0.5, None) for a, b in [(0, 5), (5, 17), (17, 24)]]
    out, lse = merge_stacked(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    assert (with_sink(out, lse, sink) - want).abs().max() < 1e-13
    stacked = torch.stack([pack_partial(p, q.shape, torch.float64, "cpu") for p in parts])
    assert (merge_packed_out(stacked, sink) - want).abs().max() < 1e-13
    empty = torch.zeros(2, 3, 5, 8, dtype=torch.float64), torch.full((2, 3, 5), -math.inf, dtype=torch.float64)
    assert (with_sink(*empty, sink) == 0).all()
    assert (merge_packed_out(torch.stack([pack_partial(None, q.shape, torch.float64, "cpu")] * 2), sink) == 0).all()


def test_merge_keeps_empty_rows_finite():
    out = torch.zeros(2, 1, 3, 4)
    lse = torch.full((2, 1, 3), -math.inf)
    o, lse_m = merge_stacked(out, lse)
    assert torch.isneginf(lse_m).all() and (o == 0).all()


@pytest.mark.parametrize("window", [None, 6])
def test_attend_with_per_sequence_key_columns(window):
    """After batched pass-Q decode each sequence holds different columns on a rank (-1: empty slot)."""
    torch.manual_seed(0)
    kc = torch.tensor([[0, 1, 2, 5, 8, -1], [0, 1, 2, 4, 7, 10]])
    qc = torch.tensor([11])
    q = torch.randn(2, 4, 1, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, 6, 8, dtype=torch.float64), torch.randn(2, 2, 6, 8, dtype=torch.float64)
    k[0, :, 5] = 1e3  # an empty slot (the cache zero-fills them) must not leak in
    out, lse = attend(q, k, v, qc, kc, scale=0.3, window=window)
    for b in range(2):
        keep = (kc[b] >= 0) & (kc[b] <= 11) & ((11 - kc[b] < window) if window else True)
        o, lse_b = _math(q[b : b + 1], k[b : b + 1, :, keep], v[b : b + 1, :, keep], None, 0.3, None)
        assert (out[b] - o[0]).abs().max() < 1e-12 and (lse[b] - lse_b[0]).abs().max() < 1e-12


def test_balanced_partitions_equalise_predicted_work():
    """Later ranks' queries see more keys: they take fewer tokens, so each rank's predicted work is even;
    with no attention cost they are even, and too short a part falls back to even ones."""
    from hf_contextpar.plan.partitions import balanced, even

    def work(a, b, past, per_token, per_pair):
        return per_token * (b - a) + per_pair * sum(past + t + 1 for t in range(a, b))

    for world, past in [(2, 0), (3, 0), (4, 100)]:
        sizes = balanced(1000, world, past, 5.0, 1.0)
        assert sum(sizes) == 1000 and sizes == sorted(sizes, reverse=True)
        bounds = [0, *__import__("itertools").accumulate(sizes)]
        works = [work(a, b, past, 5.0, 1.0) for a, b in zip(bounds, bounds[1:])]
        assert max(works) - min(works) <= 2 * (5.0 + past + 1000), works  # within about one token's work
    assert balanced(1000, 4, 0, 1.0, 0.0) == even(1000, 4)
    assert balanced(5, 2, 0, 0.0, 1.0) == even(5, 2)  # the last part would be 1 token


def test_measured_work_fits_the_ranks_busy_times():
    """MeasuredWork scales the model's token and key terms to measured seconds: both recovered when the rows tell
    them apart, one common scale when they do not, none before any measurement; key_pairs counts what a
    partition's queries see."""
    from hf_contextpar.plan.partitions import MeasuredWork, key_pairs

    assert key_pairs(3, 7, 10) == sum(10 + t + 1 for t in range(3, 7))
    work = MeasuredWork(keep=4)
    assert work.scales() == (1.0, 1.0)
    rows = [(x, y, 3.0 * x + 0.5 * y) for x, y in [(10.0, 2.0), (6.0, 9.0), (8.0, 5.0)]]
    work.add(rows)
    assert all(abs(got - want) < 1e-9 for got, want in zip(work.scales(), (3.0, 0.5)))
    work.add([(4.0, 2.0, 12.0), (2.0, 1.0, 6.0), (6.0, 3.0, 18.0), (8.0, 4.0, 24.0)])  # keeps the last 4: collinear
    assert work.scales() == (2.0, 2.0)


@pytest.mark.parametrize("window,padded,per_head", [(None, False, 0), (None, True, 0), (4, True, 0), (None, True, 2)])
def test_attend_with_a_selection_over_key_blocks_is_the_masked_whole(window, padded, per_head):
    """Indexed attention (DSA): each query's kept keys, as global columns, restrict every block it attends; the
    blocks' partials merge into the attention of the whole row under visibility & selection. per_head: one
    selection per KV head (a block indexer's, MiniMax-M3's), each for its group of query heads."""
    torch.manual_seed(1)
    b, total = 2, 20
    qc = torch.cat([torch.arange(3, 6), torch.arange(14, 20)])  # a head-tail shard's queries
    q = torch.randn(b, 4, len(qc), 8, dtype=torch.float64)
    k, v = torch.randn(b, 2, total, 8, dtype=torch.float64), torch.randn(b, 2, total, 8, dtype=torch.float64)
    valid = torch.rand(b, total) > 0.2 if padded else None
    select = torch.rand(b, per_head, len(qc), total) > 0.5 if per_head else torch.rand(b, len(qc), total) > 0.5
    blocks = [torch.arange(0, 7), torch.arange(7, 13), torch.arange(13, 20)]
    acc = Accumulator(len(qc))
    for kc in blocks:
        part = valid[:, kc] if valid is not None else None
        attend(q, k[:, :, kc], v[:, :, kc], qc, kc, scale=0.3, key_valid=part, window=window, select=select, into=acc)
    vis = (select.repeat_interleave(2, dim=1) if per_head else select[:, None]) & (torch.arange(total) <= qc[:, None])
    if window is not None:
        vis &= torch.arange(total) > qc[:, None] - window
    if valid is not None:
        vis &= valid[:, None, None, :]
    out, lse = _math(q, k, v, vis, 0.3, None)
    got = acc.result()
    seen = ~torch.isneginf(lse)
    assert torch.equal(torch.isneginf(got[1]), ~seen) and (got[0][~seen] == 0).all()
    assert (got[0] - out)[seen].abs().max() < 1e-12 and (got[1] - lse)[seen].abs().max() < 1e-12


# -- the output gather: every rank's rows back in order, whatever dims sit around them ------------------------------
class _Gathered:
    """A Comm stand-in whose all_gather returns every simulated rank's padded rows (filled in by the test)."""

    def __init__(self):
        self.blocks = []

    def all_gather(self, t, tag=None):
        return torch.stack(self.blocks)


@pytest.mark.parametrize(
    "shape, streams, dim",
    [
        ((2, 7, 5), False, 1),  # logits / hidden states (B, T, H)
        ((4, 2, 7, 5), False, 1),  # Gemma 3n's AltUp stack (4, B, T, H)
        ((2, 7, 3, 5), True, 1),  # hyper-connections' streams after the tokens (B, T, hc, H): hy_v4, deepseek_v4
        ((2, 7, 5), True, 1),  # a hyper-connection model's last hidden state, (B, T, H)
        ((3, 1, 4, 5), True, 0),  # batch rows (batched decode) of (B, 1, hc, H)
    ],
)
def test_gather_rows_puts_every_ranks_rows_back_along_the_token_or_batch_dim(shape, streams, dim):
    from hf_contextpar.outputs import gather_rows
    from hf_contextpar.plan.forward import Gather

    full = torch.randn(shape, dtype=torch.float64)
    axis = dim if streams else (full.dim() - 2 if dim == 1 else full.dim() - 3)
    total = full.shape[axis]
    slots = [torch.arange(total)[::2], torch.arange(total)[1::2]]  # interleaved, uneven when total is odd
    gather = Gather(slots=slots, total=total, dim=dim)
    comm = _Gathered()
    rows = max(s.numel() for s in slots)
    for s in slots:  # what each rank's gather_rows puts into the all-gather: its rows, padded
        mine = full.index_select(axis, s).movedim(axis, 0)
        comm.blocks.append(torch.cat([mine, mine.new_zeros((rows - mine.shape[0], *mine.shape[1:]))]))
    local = full.index_select(axis, slots[0])
    assert torch.equal(gather_rows(local, gather, comm, streams), full)


def test_input_fingerprint_is_its_definition():
    """The input check's hash (Python for small parts, one dot against cached weights for large ones) equals
    the five tensor ops it is defined by, wrapping in int64, across the small/large boundary, growing the
    weights past what an earlier call cached, for lists of ints and float masks; and it tells one changed element."""
    from hf_contextpar.comm.agreement import _SMALL, _reference_fingerprint, int_fingerprint

    g = torch.Generator().manual_seed(0)
    for sizes in [(1, 4097, 1), (0, _SMALL, _SMALL + 1, 5), (70000, 3), (2, 9000)]:
        parts = [torch.randint(-(2**62), 2**62, (s,), generator=g) for s in sizes]
        parts += [torch.ones(2, 3, dtype=torch.bool), torch.randint(0, 9, (70,), dtype=torch.int32, generator=g)]
        parts += [[3, True, 0], list(range(_SMALL + 4))]
        parts += [torch.tensor([[1.0, 0.0, 1.0]]), torch.rand(2, 20, generator=g) * 3]  # a float mask: as its .long()
        assert int_fingerprint(parts) == _reference_fingerprint(parts), sizes
    mask = torch.ones(1, 5000, dtype=torch.long)
    before = int_fingerprint([mask])
    mask[0, 1234] = 0
    assert int_fingerprint([mask]) != before


@pytest.mark.parametrize("packed", [torch.float32, torch.float64])
@pytest.mark.parametrize("same_dtype", [True, False])
@pytest.mark.parametrize("width", [0, 3])  # a padded output's extra columns, which stay home
def test_pack_partial_is_its_definition(packed, same_dtype, width):
    """pack_partial's one-op path (output and LSE already of the packed dtype and shape) and its element-wise
    path (another dtype, a padded output) both pack the output's first D columns and the LSE in the packed dtype."""
    g = torch.Generator().manual_seed(1)
    dtype = packed if same_dtype else torch.bfloat16
    out, lse = torch.randn(2, 3, 5, 4 + width, generator=g).to(dtype), torch.randn(2, 3, 5, generator=g).to(dtype)
    want = torch.empty(2, 3, 5, 5, dtype=packed)
    want[..., :4], want[..., 4] = out[..., :4].to(packed), lse.to(packed)
    got = pack_partial((out, lse), torch.Size((2, 3, 5, 4)), packed, out.device)
    assert got.dtype == packed and torch.equal(got, want)


def test_candidate_decoding_is_refused_from_embeddings_and_over_a_filled_cache():
    """Assisted and prompt-lookup decoding: refused from inputs_embeds (transformers drafts from input_ids) and over
    a cache that holds tokens (its first verification forward feeds the whole sequence again on top: one process
    holds the context twice, and on DSA the patched model could not match it: seed 21 case 6 on N = 3), before any
    collective; plain generate() and candidate decoding from an empty cache pass, on indexed attention too."""
    from types import SimpleNamespace

    from transformers import DynamicCache

    from hf_contextpar import CacheMismatchError, CandidateDecodingError
    from hf_contextpar.model.candidates import refuse_candidate_decoding

    model = SimpleNamespace(generation_config=SimpleNamespace(), forward=lambda input_ids=None, cache=None: None)
    embeds = dict(inputs_embeds=torch.zeros(1, 2, 4))
    filled = DynamicCache()
    filled.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0)
    with pytest.raises(CandidateDecodingError, match="from inputs_embeds are not supported"):
        refuse_candidate_decoding(model, (), {**embeds, "prompt_lookup_num_tokens": 3})
    for name in ("cache", "past_key_values"):
        with pytest.raises(CacheMismatchError, match="holding 3 tokens"):
            refuse_candidate_decoding(model, (), {"assistant_model": object(), name: filled})
        refuse_candidate_decoding(model, (), {"prompt_lookup_num_tokens": 3, name: DynamicCache()})
        refuse_candidate_decoding(model, (), {name: filled})  # greedy continues a filled cache
    refuse_candidate_decoding(model, (), {"prompt_lookup_num_tokens": 3, "cache": None, "past_key_values": filled})
    refuse_candidate_decoding(model, (), {"prompt_lookup_num_tokens": 3})
    refuse_candidate_decoding(model, (), embeds)


def test_kv_runahead_posts_receives_for_the_layer_attended_next():
    """KV-Runahead posts its next layer's receives as soon as a layer is done: the layer an earlier forward attended
    after it (`Step.kv_shapes` keeps their first order), not l + 1. A looped section's copies (Dory's: cache layers
    0, 1, 2, then the copies 4, 5, then 3) would else post receives the next layer's messages do not fit. None before
    a forward has shown it; a layer counted without a cache (negative) never receives."""
    import types

    from hf_contextpar.attention.kv_runahead import _following

    def step(layer, order):
        return types.SimpleNamespace(layer=layer, kv_shapes=dict.fromkeys(order, (2, 2, 16)))

    looped = [0, 1, 2, 4, 5, 3]
    assert [_following(step(layer, looped)) for layer in looped] == [1, 2, 4, 5, 3, None]
    assert _following(step(1, [0, 1])) is None  # the first forward: layer 2 not shown yet
    assert _following(step(0, [-1, 0, -2, 1])) == 1
