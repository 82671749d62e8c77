"""ShardedCache against DynamicCache, method by method, on one process.

With one rank the sharded cache holds every token, so after any sequence of the Cache calls
generate() and the models make (update, crop with edge values, beam reorder, batch expansion and
selection, reset, early initialisation, the length and mask-size queries) its keys and values
must equal DynamicCache's exactly. Multi-rank behaviour of the same methods is covered by the
multi-process tests (assisted decoding, prompt lookup, beams, the caller-kept cache)."""

import itertools
import types

import pytest
import torch
from transformers import DynamicCache

import hf_contextpar
from hf_contextpar.attention.indexed import Indexer
from hf_contextpar.cache.layers import KVOnly, Recurrent
from hf_contextpar.cache.sharded import ShardedCache
from hf_contextpar.plan.context import forward_context
from hf_contextpar.plan.forward import build_plan
from hf_contextpar.plan.policy import Policy

LAYERS, B, H, D = 2, 3, 2, 4


def forward(cache: ShardedCache, dyn: DynamicCache, num_new: int, seed: int):
    """One forward's K/V into both caches, as the runtime does: plan, begin, update per layer, end."""
    g = torch.Generator().manual_seed(seed)
    past = cache.layout.seq_length
    plan = build_plan(
        Policy(1),
        cache.layout,
        batch=B,
        num_new=num_new,
        position_ids=torch.arange(past, past + num_new).expand(B, -1),
        padding=None,
    )
    cache.begin(forward_context(plan, 0, None))
    for layer in range(LAYERS):
        k, v = torch.randn(2, B, H, num_new, D, generator=g, dtype=torch.float64)
        cache.update(k, v, layer)
        dyn.update(k, v, layer)
    cache.end()


def same(cache: ShardedCache, dyn: DynamicCache):
    assert cache.get_seq_length() == dyn.get_seq_length()
    for layer in range(LAYERS):
        assert cache.get_mask_sizes(5, layer) == dyn.get_mask_sizes(5, layer)
        if dyn.get_seq_length() == 0:
            continue
        assert torch.equal(cache.layers[layer].keys, dyn.layers[layer].keys)
        assert torch.equal(cache.layers[layer].values, dyn.layers[layer].values)


def fresh():
    return ShardedCache(LAYERS, 0, 1), DynamicCache()


def test_properties_match():
    cache, dyn = fresh()
    forward(cache, dyn, 4, 0)
    assert cache.is_compileable == dyn.is_compileable is False
    assert cache.is_croppable and dyn.is_croppable
    assert cache.get_max_length() == dyn.get_max_length() == -1
    assert cache.get_seq_length(layer_idx=LAYERS + 3) == dyn.get_seq_length(layer_idx=LAYERS + 3) == 0


@pytest.mark.parametrize("remove", [0, -1, -3, -7, -100])
def test_crop_like_dynamic_cache(remove):
    """crop(0) keeps everything (assisted decoding calls it when every draft is accepted);
    crop(-n) drops the newest n, never below zero."""
    cache, dyn = fresh()
    forward(cache, dyn, 5, 0)
    forward(cache, dyn, 2, 1)
    cache.crop(remove)
    dyn.crop(remove)
    same(cache, dyn)
    forward(cache, dyn, 3, 2)  # and it keeps working afterwards
    same(cache, dyn)


def test_positive_crop_is_refused_like_dynamic_cache():
    cache, dyn = fresh()
    forward(cache, dyn, 5, 0)
    for c in (cache, dyn):
        with pytest.raises(ValueError, match="negative"):
            c.crop(3)
    same(cache, dyn)


def test_beam_and_batch_methods():
    cache, dyn = fresh()
    forward(cache, dyn, 6, 0)
    for c in (cache, dyn):
        c.reorder_cache(torch.tensor([2, 0, 0]))
    same(cache, dyn)
    for c in (cache, dyn):
        c.batch_repeat_interleave(2)
    assert cache.layers[0].keys.shape[0] == 2 * B
    same(cache, dyn)
    for c in (cache, dyn):
        c.batch_select_indices(torch.tensor([5, 1, 2]))
    same(cache, dyn)


def test_reset_empties_but_keeps_the_object():
    cache, dyn = fresh()
    forward(cache, dyn, 6, 0)
    cache.reset()
    dyn.reset()
    assert cache.get_seq_length() == dyn.get_seq_length() == 0
    assert cache.layout.counts() == [0]
    forward(cache, dyn, 2, 1)
    same(cache, dyn)


def test_early_initialization():
    cache, dyn = fresh()
    cache.early_initialization(batch_size=B, num_heads=H, head_dim=D, dtype=torch.float64, device="cpu")
    assert cache.is_initialized and cache.get_seq_length() == 0
    forward(cache, dyn, 3, 0)
    same(cache, dyn)


def test_bind_turns_the_callers_dynamic_cache_into_the_sharded_cache():
    """The in-place pattern: the caller's object itself carries the sharded state afterwards."""
    dyn = DynamicCache()
    dyn._is_user_defined = True  # generate() marks caches the caller passed
    bound = ShardedCache.bind(dyn, LAYERS, 0, 1)
    assert bound is dyn and isinstance(dyn, ShardedCache) and dyn._is_user_defined
    ref = DynamicCache()
    forward(dyn, ref, 4, 0)
    same(dyn, ref)


def test_failed_forward_leaves_no_trace():
    """A forward that raises is rolled back: the layout and every layer keep what they had."""
    cache, dyn = fresh()
    forward(cache, dyn, 4, 0)
    plan = build_plan(
        Policy(1), cache.layout, batch=B, num_new=2, position_ids=torch.arange(4, 6).expand(B, -1), padding=None
    )
    cache.begin(forward_context(plan, 0, None))
    cache.update(*torch.randn(2, B, H, 2, D, dtype=torch.float64), 0)  # layer 0 stored, then the forward failed
    cache.end(ok=False)
    same(cache, dyn)


# -- sliding layers: what DynamicCache(config=...) keeps ----------------------------------------------
WINDOW = 5


def _sliding_config():
    from transformers import Qwen2Config

    return Qwen2Config(
        num_hidden_layers=LAYERS,
        use_sliding_window=True,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
    )


def sliding_pair(bound: bool = False):
    """A cache whose layer 0 is a sliding window of WINDOW and layer 1 full, and the DynamicCache one
    process makes for that config (`bound`: the ShardedCache made by binding such a DynamicCache)."""
    config = _sliding_config()
    dyn = DynamicCache(config=config)
    cache = ShardedCache.bind(DynamicCache(config=config), LAYERS, 0, 1) if bound else None
    if cache is None:
        from hf_contextpar.cache.sharded import cache_windows

        cache = ShardedCache(LAYERS, 0, 1, cache_windows(DynamicCache(config=config)))
    assert cache.windows == (WINDOW, None) and cache.layers[0].is_sliding and not cache.layers[1].is_sliding
    return cache, dyn


def same_kept(cache, dyn):
    """Every layer holds exactly the keys and values the single-process cache holds."""
    assert cache.get_seq_length() == dyn.get_seq_length()
    for layer in range(LAYERS):
        if dyn.layers[layer].keys is None or dyn.layers[layer].keys.numel() == 0:
            assert cache.layers[layer].live == 0
            continue
        assert torch.equal(cache.layers[layer].keys, dyn.layers[layer].keys)
        assert torch.equal(cache.layers[layer].values, dyn.layers[layer].values)


@pytest.mark.parametrize("bound", [False, True])
def test_sliding_layer_keeps_what_dynamic_cache_keeps(bound):
    """Prefill longer than the window, short ones, decode steps: the sliding layer keeps the last
    window - 1 tokens after every forward, and the K/V a forward sees are the same."""
    cache, dyn = sliding_pair(bound)
    for i, n in enumerate([3, 9, 1, 1, 2, 1, 7, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]):
        forward(cache, dyn, n, i)
        same_kept(cache, dyn)
    assert cache.layers[0].live == WINDOW - 1
    assert cache.layers[0].kv.shape[3] <= 64  # the 9-token buffer was not kept at its old size forever


def test_sliding_layer_gives_back_a_long_prefill():
    cache, dyn = sliding_pair()
    forward(cache, dyn, 300, 0)
    same_kept(cache, dyn)
    assert cache.layers[0].kv.shape[3] < 300 and cache.layers[1].live == 300
    assert cache.local_nbytes() == (WINDOW - 1 + 300) * 2 * B * H * D * 8


def test_sliding_crop_needs_past_recording_like_dynamic_cache():
    cache, dyn = sliding_pair()
    forward(cache, dyn, 8, 0)
    for c in (cache, dyn):
        with pytest.raises(RuntimeError, match="activate_past_recording"):
            c.crop(-1)
    same_kept(cache, dyn)


@pytest.mark.parametrize("remove", [0, -1, -3, -6])
def test_sliding_crop_while_recording_the_past(remove):
    """Assisted decoding's pattern: record the past, add draft tokens, crop the rejected ones."""
    cache, dyn = sliding_pair()
    forward(cache, dyn, 8, 0)
    for c in (cache, dyn):
        c.activate_past_recording()
    assert cache.is_recording_past(0) and cache.is_recording_past(1)
    forward(cache, dyn, 6, 1)
    same_kept(cache, dyn)  # nothing dropped while recording
    for c in (cache, dyn):
        c.crop(remove)
    same_kept(cache, dyn)
    forward(cache, dyn, 1, 2)
    same_kept(cache, dyn)
    for c in (cache, dyn):  # what generate() does when it hands the cache back
        for layer in c.layers:
            if hasattr(layer, "record_past"):
                layer.record_past = False
    forward(cache, dyn, 2, 3)
    same_kept(cache, dyn)


def test_bind_keeps_past_recording():
    """generate()'s assisted decoding switches recording on before the first forward binds the cache."""
    bound_dyn = DynamicCache(config=_sliding_config())
    bound_dyn.activate_past_recording()
    bound = ShardedCache.bind(bound_dyn, LAYERS, 0, 1)
    assert bound.layout.record_past and bound.is_recording_past(0)


def test_sliding_crop_past_what_was_kept_is_refused():
    """Recording switched on late: the keys a deep crop needs again are gone, so it says so (transformers
    would return a cache with fewer keys than its window, silently)."""
    cache, _ = sliding_pair()
    forward(cache, DynamicCache(), 12, 0)
    cache.activate_past_recording()
    forward(cache, DynamicCache(), 2, 1)
    with pytest.raises(Exception, match="further than this cache's sliding layers kept"):
        cache.crop(-6)


def test_sliding_beam_methods_and_failed_forward():
    cache, dyn = sliding_pair()
    forward(cache, dyn, 9, 0)
    for c in (cache, dyn):
        c.reorder_cache(torch.tensor([2, 0, 0]))
        c.batch_repeat_interleave(2)
        c.batch_select_indices(torch.tensor([5, 1, 2]))
    same_kept(cache, dyn)
    forward(cache, dyn, 1, 1)
    same_kept(cache, dyn)
    plan = build_plan(
        Policy(1), cache.layout, batch=B, num_new=2, position_ids=torch.arange(10, 12).expand(B, -1), padding=None
    )
    cache.begin(forward_context(plan, 0, None))
    cache.update(*torch.randn(2, B, H, 2, D, dtype=torch.float64), 0)
    cache.end(ok=False)
    same_kept(cache, dyn)
    forward(cache, dyn, 1, 2)
    same_kept(cache, dyn)


def test_local_nbytes_with_an_emptied_sliding_layer():
    """A rank whose sliding layer holds nothing after a trim (window 2: the one kept token is on another
    rank) still reports its bytes (the buffer may be empty)."""
    from hf_contextpar.cache.sharded import ShardedLayer

    cache, dyn = sliding_pair()
    forward(cache, dyn, 300, 0)
    layer = cache.layers[0]
    assert isinstance(layer, ShardedLayer)
    assert layer.kv.shape[3] < 64  # the 300-token prefill buffer was given back at commit
    layer.trim(layer.live)  # everything gone, as on a rank that holds none of the window
    assert layer.live == 0
    assert cache.local_nbytes() == 300 * 2 * B * H * D * 8
    layer.kv, layer.first, layer.n = layer.kv[:, :, :, :0], 0, 0  # what trim leaves of a large emptied buffer
    assert cache.local_nbytes() == 300 * 2 * B * H * D * 8


def test_recurrent_and_hybrid_layers_keep_transformers_semantics():
    """Recurrent layers are transformers' own (whole on every rank), hybrid ones hold both: reorder_cache,
    crop and reset behave as in the single-process cache built from the same layer kinds."""
    from transformers.cache_utils import (
        Cache,
        DynamicLayer,
        LinearAttentionAndFullAttentionLayer,
        LinearAttentionLayer,
    )

    from hf_contextpar.cache.layers import ShardedHybridLayer

    sharded = ShardedCache(3, 0, 1, recurrence=[Recurrent(1), KVOnly(), Recurrent(1, kv=True)])
    single = Cache(layers=[LinearAttentionLayer(), DynamicLayer(), LinearAttentionAndFullAttentionLayer()])
    assert [type(x).__name__ for x in sharded.layers] == ["LinearAttentionLayer", "ShardedLayer", "ShardedHybridLayer"]
    assert isinstance(sharded.layers[2], ShardedHybridLayer) and sharded.kv_layers == sharded.layers[1:]
    g = torch.Generator().manual_seed(0)
    conv, state = torch.randn(3, 4, 5, generator=g), torch.randn(3, 2, 6, generator=g)
    for cache in (sharded, single):
        for i in (0, 2):
            cache.update_conv_state(conv, i)
            cache.update_recurrent_state(state, i)
        assert cache.has_previous_state(0) and not cache.is_croppable
        cache.reorder_cache(torch.tensor([2, 0, 1]))
    for i in (0, 2):
        assert torch.equal(sharded.get_conv_state(i), single.get_conv_state(i))
        assert torch.equal(sharded.get_recurrent_state(i), single.get_recurrent_state(i))
    for cache in (sharded, single):  # crop needs recorded past on a recurrent layer, as one process has it
        with pytest.raises(RuntimeError, match="does not track past states"):
            cache.crop(0)
        cache.reset()
        assert not cache.has_previous_state(0) and cache.get_conv_state(2) is None


# -- indexed attention (DSA): the index keys' bookkeeping, as DynamicIndexedLayer's -----------------------------
class _OneRank:
    """The Comm of a world of one: every block broadcast is this rank's own."""

    rank, world = 0, 1

    def broadcast_blocks(self, mine, shapes, op="broadcast"):
        assert op == "index_keys"  # counted apart from the attention's own bytes (the bench reports them)
        return [types.SimpleNamespace(wait=lambda: mine)]


def begin_indexed(cache: ShardedCache, plan, rank: int, comm, position_ids=None):
    """A forward with indexed attention, as the runtime begins it: its context handed to the cache, then its
    indexer (attention/indexed.py) put on that context."""
    context = forward_context(plan, rank, comm)
    cache.begin(context)
    context.indexer = Indexer(context, cache, position_ids)


def indexed_forward(cache: ShardedCache, ref: list, num_new: int, seed: int, ok: bool = True):
    """One forward's index keys through `update_indexer` (layer 0) and its K/V; ref: one process's index keys."""
    past = cache.layout.seq_length
    plan = build_plan(
        Policy(1), cache.layout, batch=B, num_new=num_new, position_ids=torch.arange(past, past + num_new), padding=None
    )
    begin_indexed(cache, plan, 0, _OneRank())
    new = torch.randn(B, num_new, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    full = cache.update_indexer(new, 0)
    assert torch.equal(full, torch.cat([*ref, new], dim=1))  # every column, in order
    for layer in range(LAYERS):
        cache.update(*torch.randn(2, B, H, num_new, D, dtype=torch.float64), layer)
    cache.end(ok)
    if ok:
        ref.append(new)


def test_index_keys_follow_the_cache_through_beams_crop_and_failure():
    cache, ref = ShardedCache(LAYERS, 0, 1), []
    indexed_forward(cache, ref, 6, 0)
    indexed_forward(cache, ref, 3, 1, ok=False)  # rolled back: the keys as they were
    assert cache.index_length == 6 and torch.equal(cache.index_keys[0], torch.cat(ref, 1))
    cache.reorder_cache(torch.tensor([2, 0, 0]))
    ref[:] = [r[[2, 0, 0]] for r in ref]
    cache.crop(-2)
    ref[:] = [torch.cat(ref, 1)[:, :4]]
    indexed_forward(cache, ref, 1, 2)  # and it keeps working afterwards
    assert cache.index_length == 5 and cache.context is None  # none outside a forward
    with pytest.raises(hf_contextpar.errors.PatchStateError, match="works only with the patched model"):
        cache.update_indexer(ref[0], 0)
    cache.reset()
    assert cache.index_keys == {}


# -- Qwen4-Exp's QSA: its position history (indexer_position_ids) and its narrowed mask as the selection ------------
class _Ranks:
    """The Comm of rank `rank` of a simulated world: every other rank's block is cut from the global truth."""

    def __init__(self, rank, world, truth, cols):
        self.rank, self.world, self.truth, self.cols = rank, world, truth, cols

    def broadcast_blocks(self, mine, shapes, op="broadcast"):
        blocks = [mine if r == self.rank else self.truth[:, c].unsqueeze(-1) for r, c in enumerate(self.cols)]
        return [types.SimpleNamespace(wait=lambda b=b: b) for b in blocks]


@pytest.mark.parametrize("world", [1, 3])
def test_position_history_is_every_column_in_order_then_the_queries(world):
    """What the model reads is every column's positions in global order (this forward's included), whatever this
    rank's (head-tail) query columns; what it writes back is checked; each rank stores its own columns' share,
    which follows a failed forward, beams and crop as the index keys do."""
    caches = [ShardedCache(LAYERS, r, world) for r in range(world)]
    truth = torch.empty(B, 0, dtype=torch.long)
    for num_new, ok in ((11, True), (4, False), (5, True), (1, True)):
        past = caches[0].layout.seq_length
        pos = (torch.arange(past, past + num_new) * 7 + torch.arange(B)[:, None]) % 1000  # not the column numbers
        new_truth = torch.cat([truth, pos], 1)
        plans = []
        for cache in caches:
            plan = build_plan(Policy(world), cache.layout, batch=B, num_new=num_new, position_ids=pos, padding=None)
            plans.append(plan)
            rank = cache.layout.rank
            mine = pos[:, plan.shards.q_cols[rank] - past]  # this rank's new tokens' positions (q: global columns)
            cols = [torch.cat([c, n]) for c, n in zip(cache.layout.cols, plan.shards.q_cols)]
            comm = _Ranks(rank, world, new_truth, cols)
            begin_indexed(cache, plan, rank, comm, mine)
        for cache, plan in zip(caches, plans):
            rank = cache.layout.rank
            q = plan.shards.q_cols[rank]
            mine = pos[:, q - past]
            layer = cache.layers[0]
            seen = layer.indexer_position_ids
            assert (
                seen.shape == (3, B, past + num_new)
                and torch.equal(seen[0], new_truth)
                and torch.equal(seen[2], seen[0])
            )
            model_wrote = torch.cat([seen, mine.expand(3, -1, -1)], dim=-1)  # as the model does
            assert torch.equal(model_wrote[..., -q.numel() :][0], mine)  # its query slice: this rank's own
            layer.indexer_position_ids = model_wrote
            with pytest.raises(hf_contextpar.errors.PatchStateError, match="position ids of shape"):
                layer.indexer_position_ids = seen
            for i in range(LAYERS):
                k = torch.randn(2, B, H, q.numel(), D, dtype=torch.float64)
                cache.update(k[0], k[1], i)
        for cache in caches:
            cache.end(ok)
            assert cache.context is None and cache.layers[0].indexer_position_ids is None
        if ok:
            truth = new_truth
        for cache in caches:  # this rank's columns' positions only: 1/N of the history
            held = cache.index_keys["positions"][..., 0]
            assert torch.equal(held, truth[:, cache.layout.cols[cache.layout.rank]])
    assert sum(c.index_keys["positions"].shape[1] for c in caches) == truth.shape[1]
    for cache in caches:
        cache.reorder_cache(torch.tensor([2, 0, 0]))
        cache.crop(-3)
        held = cache.index_keys["positions"][..., 0]
        assert torch.equal(held, truth[[2, 0, 0]][:, : truth.shape[1] - 3][:, cache.layout.cols[cache.layout.rank]])


def test_a_narrowed_indexer_mask_is_the_layers_selection():
    """Qwen4-Exp hands its top blocks as the indexer's mask narrowed (its family hook, patches/qwen4_exp.py): taken
    as the selection on an indexed layer, never a mask that shows a key the indexer's mask hid (left to the adapter,
    which refuses it as a mask of the layer's own), nor on a layer that is not indexed; the indexer's own mask handed
    back is no mask of the layer's; a family without the hook never narrows (its layer is then refused for giving no
    selection)."""
    from hf_contextpar.patches import qwen4_exp

    from hf_contextpar.attention.indexed import MASK, layer_selection
    from hf_contextpar.model.families import DEFAULT_HOOKS

    ours = torch.rand(2, 1, 3, 9, generator=torch.Generator().manual_seed(0)) < 0.7
    step = types.SimpleNamespace(
        indexed=frozenset({1}), state={MASK: ours}, family=qwen4_exp.HOOKS, algorithm="ring_pass_kv"
    )
    layer = types.SimpleNamespace(layer_idx=1)
    kept = ours & (torch.rand(ours.shape, generator=torch.Generator().manual_seed(1)) < 0.5)
    select, left = layer_selection(step, layer, kept, None)
    assert torch.equal(select, kept[:, 0]) and left is None
    shows = kept | ~ours
    assert layer_selection(step, layer, shows, None) == (None, shows)  # the adapter refuses it as a foreign mask
    assert layer_selection(step, layer, kept.float(), None)[0] is None
    assert layer_selection(step, types.SimpleNamespace(layer_idx=0), kept, None) == (None, kept)  # not indexed
    no_hook = types.SimpleNamespace(**{**vars(step), "family": DEFAULT_HOOKS})
    assert layer_selection(no_hook, layer, kept, None) == (None, kept)
    with pytest.raises(hf_contextpar.UnsupportedModelError, match="no top-k selection"):
        layer_selection(step, layer, ours, None)  # the indexer's mask itself, no indices: no selection at all


# -- MiniMax-M3's block indexer: index keys through its cache layer's update_index, its top blocks per KV head -------
class _KeyRanks:
    """The Comm of rank `rank` of a simulated world: every other rank's index keys are cut from the global truth."""

    def __init__(self, rank, truth, cols):
        self.rank, self.world, self.truth, self.cols = rank, len(cols), truth, cols

    def broadcast_blocks(self, mine, shapes, op="broadcast"):
        assert op == "index_keys" and [tuple(s) for s in shapes] == [(B, c.numel(), 8) for c in self.cols]
        blocks = [mine if r == self.rank else self.truth[:, c] for r, c in enumerate(self.cols)]
        return [types.SimpleNamespace(wait=lambda b=b: b) for b in blocks]


@pytest.mark.parametrize("world", [1, 3])
def test_update_index_hands_every_column_of_one_head_in_order(world):
    """MiniMax-M3's indexer calls `update_index` (B, 1, T_new, D) on its layer's cache layer: the sharded layer answers
    with every column's index keys (B, 1, T, D) in global order, whatever this rank's (head-tail) columns, and each
    rank stores only its own share; outside a forward, or with more than one head, it is refused."""
    caches = [ShardedCache(LAYERS, r, world) for r in range(world)]
    truth = torch.empty(B, 0, 8, dtype=torch.float64)
    for num_new in (11, 5, 1):
        past = caches[0].layout.seq_length
        new_truth = torch.cat([truth, torch.randn(B, num_new, 8, dtype=torch.float64)], 1)
        for cache in caches:
            rank = cache.layout.rank
            pos = torch.arange(past, past + num_new)
            plan = build_plan(Policy(world), cache.layout, batch=B, num_new=num_new, position_ids=pos, padding=None)
            q = plan.shards.q_cols[rank]
            cols = [torch.cat([c, n]) for c, n in zip(cache.layout.cols, plan.shards.q_cols)]
            begin_indexed(cache, plan, rank, _KeyRanks(rank, new_truth, cols), pos[q - past])
            with pytest.raises(hf_contextpar.errors.PatchStateError, match="takes one head"):
                cache.layers[1].update_index(new_truth[:, q].unsqueeze(1).expand(-1, 2, -1, -1))
            seen = cache.layers[1].update_index(new_truth[:, q].unsqueeze(1))
            assert torch.equal(seen, new_truth.unsqueeze(1))
            for i in range(LAYERS):
                cache.update(*torch.randn(2, B, H, q.numel(), D, dtype=torch.float64), i)
        for cache in caches:
            cache.end(True)
        truth = new_truth
        for cache in caches:  # 1/N of the index keys per rank, its K/V's columns
            assert torch.equal(cache.index_keys[1], truth[:, cache.layout.cols[cache.layout.rank]])
    with pytest.raises(hf_contextpar.errors.PatchStateError, match="inside the patched model's forward"):
        caches[0].layers[1].update_index(truth[:, :1].unsqueeze(1))


def test_a_block_indexers_top_blocks_are_its_layers_selection_per_kv_head():
    """MiniMax-M3's sparse layer hands its top key blocks per KV head as block_indices (its family hook,
    patches/minimax_m3.py): expanded to global columns, they are exactly the keys the model's own block mask keeps
    (MiniMaxM3VLIndexer.build_block_mask, causal); a layer the config does not declare indexed that hands blocks,
    an indexed layer of a family without the hook, and blocks past the row are refused."""
    from hf_contextpar.patches import minimax_m3
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLIndexer

    from dev.census.configs import tiny_config
    from hf_contextpar.attention.indexed import MASK, layer_selection
    from hf_contextpar.model.families import DEFAULT_HOOKS

    config = tiny_config("minimax_m3_vl_text")
    indexer = MiniMaxM3VLIndexer(config, 1)
    total, q_cols = 29, torch.cat([torch.arange(3, 8), torch.arange(22, 29)])  # a head-tail shard's queries
    g = torch.Generator().manual_seed(2)
    blocks = torch.full((2, 2, len(q_cols), 3), -1)  # (B, H_kv, Tq, k): up to 3 earlier blocks, -1 the unused slots
    for b, h, i in itertools.product(range(2), range(2), range(len(q_cols))):
        kept = torch.randperm(int(q_cols[i]) // 8 + 1, generator=g)[:3]
        blocks[b, h, i, : len(kept)] = kept
    plan = types.SimpleNamespace(batch=2, past=0, num_new=total)
    ours = torch.ones(2, 1, len(q_cols), total, dtype=torch.bool)
    step = types.SimpleNamespace(
        plan=plan,
        q_cols=q_cols,
        indexed=frozenset({1}),
        state={MASK: ours},
        family=minimax_m3.HOOKS,
        algorithm="ring_pass_kv",
    )
    layer = types.SimpleNamespace(layer_idx=1, indexer=indexer)
    select, left = layer_selection(step, layer, ours, None, dict(block_indices=blocks))
    assert left is None and select.shape == (2, 2, len(q_cols), total)
    model = indexer.build_block_mask(blocks, None, total, torch.float64, "cpu", q_cols.expand(2, -1)) == 0
    causal = torch.arange(total) <= q_cols[:, None]
    assert torch.equal(select.repeat_interleave(config.num_attention_heads // 2, dim=1) & causal, model)
    with pytest.raises(hf_contextpar.UnsupportedModelError, match="declares this layer no indexed-attention layer"):
        layer_selection(
            step, types.SimpleNamespace(layer_idx=0, indexer=indexer), ours, None, dict(block_indices=blocks)
        )
    no_hook = types.SimpleNamespace(**{**vars(step), "family": DEFAULT_HOOKS})
    with pytest.raises(hf_contextpar.UnsupportedModelError, match="no top-k selection"):
        layer_selection(no_hook, layer, ours, None, dict(block_indices=blocks))
    with pytest.raises(hf_contextpar.errors.PatchStateError, match="over 4 blocks of 8 keys"):
        layer_selection(step, layer, ours, None, dict(block_indices=blocks + 4))


# -- looped sections (Dory's, Inkling 2 Loop's): a copy of the section's cache layers per pass after the first --------
@pytest.mark.parametrize(
    "family,copies,windows",
    [
        ("dory", (1, 2), (24, 24, None, 24, 24, None)),  # two recurrent layers looped twice
        ("inkling2_loop_text", (1, 2, 1, 2), (24, 24, None, 24, 24, None, 24, None)),  # a sliding and a full, 3 passes
    ],
)
def test_a_looped_models_cache_holds_each_loops_copy_as_one_process_appends_it(family, copies, windows):
    """Dory and Inkling 2 Loop (patches/dory.py, patches/inkling2_loop.py) append, in their first forward, a copy of
    their looped section's cache layers per pass after the first and write each pass to its copy: the sharded cache
    makes those copies with itself (from no cache, and bound to generate()'s DynamicCache(config=...)), each with its
    layer's window, as one process's cache holds them after that forward; the model then finds them and appends none."""
    from dev.census.configs import build
    from hf_contextpar.model.contract import InputContract, attention_layers

    model = build(family, torch.float64, hf_contextpar.patches.REGISTRY[family].reference_attn)
    ids = torch.randint(3, 256, (1, 30), generator=torch.Generator().manual_seed(0))
    one = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=one)
    contract = InputContract(model, 0, 2, "hf_contextpar")
    assert contract.copies == copies and contract.num_layers == len(one.layers) == len(windows)
    assert attention_layers(model.config) == len(windows)  # each pass's calls counted, for the coverage check
    made = contract.new_cache()
    bound = ShardedCache.bind(DynamicCache(config=model.config), len(windows), 0, 2, contract.recurrence, copies)
    held = tuple(getattr(layer, "sliding_window", None) if layer.is_sliding else None for layer in one.layers)
    assert made.windows == bound.windows == held == windows


@pytest.mark.parametrize("family", ["openai-gpt", "rwkv"])
def test_a_cache_passed_to_a_forward_that_takes_none_is_ignored_as_one_process_ignores_it(family):
    """OpenAI GPT's and RWKV's forwards take no cache argument: one passed as `past_key_values` lands in their
    **kwargs, ignored on one process (a later turn's mask over past + new tokens then fails there). The contract reads
    no cache under any name for them (the fuzz's N = 3 case read a DynamicCache for OpenAI GPT, filled it and answered
    a second turn one process refuses)."""
    from dev.census.configs import build
    from hf_contextpar.model.contract import InputContract

    contract = InputContract(build(family, torch.float64, "default"), 0, 2, "hf_contextpar")
    given = DynamicCache()
    kwargs = {"past_key_values": given, "cache": given}
    assert contract.cache_names == () and contract._take_cache(kwargs) is None
    assert kwargs == {"past_key_values": given, "cache": given}  # left for the forward's **kwargs, as one process
    llama = InputContract(build("llama", torch.float64, "sdpa"), 0, 2, "hf_contextpar")
    assert llama._take_cache(dict(past_key_values=given)) is given  # the alias a forward that takes `cache` keeps
