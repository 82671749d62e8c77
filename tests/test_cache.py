"""ShardedCache against DynamicCache, method by method, on one process.

With one rank the sharded cache holds every token, so after any sequence of the Cache calls
generate() and the models make (update, crop with edge values, beam reorder, batch expansion and
selection, reset, early initialisation, the length and mask-size queries) its keys and values
must equal DynamicCache's exactly. Multi-rank behaviour of the same methods is covered by the
multi-process tests (assisted decoding, prompt lookup, beams, the caller-kept cache)."""

import pytest
import torch
from transformers import DynamicCache

from hf_contextpar.cache import ShardedCache
from hf_contextpar.plan import Policy, build_plan

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
    cache.begin(plan)
    for layer in range(LAYERS):
        k, v = torch.randn(2, B, H, num_new, D, generator=g, dtype=torch.float64)
        cache.update(k, v, layer)
        dyn.update(k, v, layer)
    cache.end(plan)


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
    cache.begin(plan)
    cache.update(*torch.randn(2, B, H, 2, D, dtype=torch.float64), 0)  # layer 0 stored, then the forward failed
    cache.end(plan, ok=False)
    same(cache, dyn)
