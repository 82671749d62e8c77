"""MiniMax-Text-01 / M1: its lightning-attention layers keep their state in a cache class of the model's own.

transformers' MiniMax keeps each lightning layer's state (the decayed sum of K^T V) in
`MiniMaxCache.linear_cache` (`get_linear_cache` / `set_linear_cache`) and refuses any other cache
class, while the state chain and the sharded cache work through transformers' state API (the
`LinearAttentionLayer` that `DynamicCache(config=...)` makes for those layers). On the patched model
only, this patch
- hands its lightning layers that state through the API (`_LinearStates`): a layer with a state
  (a later turn's, or the one a chained rank received) continues from it token by token, as one
  process continues from its cache; a fresh one runs its blocks from zero;
- lets its model take the ShardedCache: `use_cache` only creates and checks the cache class there
  (the layers use whatever cache they get), so a forward given a ShardedCache runs with it off;
- refuses beam search: MiniMaxCache does not reorder its lightning states with the beams (only the
  attention layers' K/V), so one process continues each beam from another beam's state.
"""

from __future__ import annotations

from hf_contextpar.cache.sharded import ShardedCache
from hf_contextpar.errors import UnsupportedInputError


class _LinearStates:
    """What a MiniMax lightning layer asks of its cache, over transformers' state API."""

    def __init__(self, cache):
        self.cache = cache

    def get_linear_cache(self, layer_idx: int):
        return self.cache.get_recurrent_state(layer_idx)  # None until the layer has a state

    def set_linear_cache(self, layer_idx: int, state):
        self.cache.update_recurrent_state(state, layer_idx)
        # transformers' mixers mark a previous state when they update their conv state, which this layer has not
        self.cache.layers[layer_idx].has_previous_state[0] = True


def _lightning(forward):
    def run(*args, cache=None, **kwargs):
        return forward(*args, cache=_LinearStates(cache) if isinstance(cache, ShardedCache) else cache, **kwargs)

    return run


def _model(forward):
    def run(*args, **kwargs):
        if isinstance(kwargs.get("cache"), ShardedCache):
            kwargs["use_cache"] = False  # else the model refuses any cache but a MiniMaxCache
        return forward(*args, **kwargs)

    return run


def _reorder_cache(cache, beam_idx):
    raise UnsupportedInputError(
        "beam search is not supported for MiniMax under context parallelism: transformers' MiniMaxCache does not "
        "reorder its lightning-attention states with the beams, so one process continues each beam from another "
        "beam's state. Use greedy decoding or sampling."
    )


def apply(model):
    """Wrap the model's lightning layers and inner model (instance attributes); returns undo()."""
    inner = model.get_decoder()
    wrapped = [(m, m.forward) for m in inner.modules() if type(m).__name__ == "MiniMaxLightningAttention"]
    for m, forward in wrapped:
        m.forward = _lightning(forward)
    inner_forward = inner.forward
    inner.forward = _model(inner_forward)
    model._reorder_cache = _reorder_cache  # generate() calls a model's own _reorder_cache when it has one

    def undo():
        for m, _ in wrapped:
            del m.forward
        del inner.forward
        del model._reorder_cache

    return undo
