"""RecurrentGemma (Griffin): its recurrent blocks' states through the cache, so that they pass down the ranks.

`RecurrentGemmaRecurrentBlock` keeps its short convolution's last `conv1d_width - 1` inputs and its RG-LRU's state on
the modules (`conv1d_state`, `rg_lru.recurrent_states`), outside the cache, so the state chain
(hf_contextpar/cache/recurrent.py) cannot pass them. Under a context-parallel cache this patch runs the block with
those states read from and written to the cache's linear-attention layer of its index (the one its config's
`layer_types` makes), conv state first, then the RG-LRU state: a chained rank continues from what rank - 1 left,
and decode from the states every rank took after prefill. One process's arithmetic, kept as it is:

- a multi-token forward convolves from zeros on its left (transformers' prefill pads the convolution, even over a
  cache: a second turn restarts it), while the RG-LRU continues from the state before the forward (position 0 resets
  it: `reset`); under the chain only the first rank starts the convolution from zeros, a later one from the inputs
  before its partition, which the chain passes (the last `conv1d_width - 1` of everything before it, so a partition
  shorter than that passes the earlier ones on);
- a one-token forward outside the chain (decode) continues both from the cache, as transformers' decode does;
- a forward the caller runs with use_cache=False (given a cache or not) starts both from zeros and leaves no state:
  transformers drops the modules' states there (the next forward starts from zeros), while the context-parallel
  runtime runs the model with the cache, so the caller's flag is read at the model's call (`_caller`) and the cache's
  states are zeroed once this rank has passed them on.

The RG-LRU itself runs unchanged (`rg_lru`, given the state to start from). Any other cache (one process) runs
transformers' block untouched. Beam search is refused: one process reorders the cache's attention layers with the
beams but not the states on its modules, so each beam continues from another beam's state, which the cache's states
(reordered with the beams) would not reproduce.
"""

from __future__ import annotations

import sys
from contextvars import ContextVar

import torch

from hf_contextpar.cache.recurrent import ChainedStates, running_chain
from hf_contextpar.errors import UnsupportedInputError

from .wrapping import install

_INDEX = "_hf_contextpar_layer_idx"  # a recurrent block's layer index (its cache layer), set by apply
_fresh: ContextVar = ContextVar("hf_contextpar_recurrent_gemma_fresh", default=False)  # the caller's use_cache=False


def _caller(module, args, kwargs):
    """Before the context-parallel runtime (which runs the model with its cache): the caller's use_cache=False."""
    _fresh.set(kwargs.get("use_cache") is False)


def _through_cache(forward):
    def block_forward(self, input_states, position_ids, attention_mask, use_cache=True, **kwargs):
        cache = kwargs.get("cache")
        if not use_cache or not isinstance(cache, ChainedStates) or getattr(self, _INDEX, None) is None:
            return forward(self, input_states, position_ids, attention_mask, use_cache, **kwargs)
        idx, tokens, width = getattr(self, _INDEX), input_states.shape[1], self.conv1d_width - 1
        y_branch = self.act_fn(self.linear_y(input_states))
        x_branch = self.linear_x(input_states).transpose(1, 2)  # (batch, lru_width, tokens)
        chain, fresh = running_chain(), _fresh.get()
        received = chain is not None and chain.receive
        before = cache.get_conv_state(idx)  # a chained rank's first touch: rank - 1's states arrive here
        if before is None or before.shape[0] != x_branch.shape[0] or (fresh and not received):
            before = x_branch.new_zeros((*x_branch.shape[:2], width))  # nothing before (transformers' zeros)
        if chain is None and tokens == 1:  # decode: transformers' one-token convolution over its cached inputs
            window = torch.cat((before, x_branch), -1)
            x_conv = (torch.sum(window * self.conv_1d.weight[:, 0, :], dim=-1) + self.conv_1d.bias).unsqueeze(-1)
        elif received:  # a later rank of a chained prefill: the inputs before its partition
            window = torch.cat((before, x_branch), -1)
            x_conv = self.conv_1d(window)[..., width : width + tokens]
        else:  # a prefill (the first rank's partition): from zeros, as transformers pads it
            window = torch.nn.functional.pad(x_branch, (width, 0))
            x_conv = self.conv_1d(x_branch)[..., :tokens]
        cache.update_conv_state(window[..., window.shape[-1] - width :].contiguous(), idx)  # goes ahead, to rank + 1
        state = cache.get_recurrent_state(idx)
        if state is None or state.shape[0] != input_states.shape[0] or (fresh and not received):
            state = torch.zeros(
                (input_states.shape[0], self.lru_width), device=input_states.device, dtype=torch.float32
            )
        kept, self.rg_lru.recurrent_states = self.rg_lru.recurrent_states, state
        try:
            x_branch = self.rg_lru(x_conv.transpose(1, 2), position_ids)
            cache.update_recurrent_state(self.rg_lru.recurrent_states, idx)
        finally:
            self.rg_lru.recurrent_states = kept
        if fresh:  # passed on already (the chain sends copies): what transformers keeps after it is nothing
            layer = cache.layers[idx]
            layer.conv_states[0].zero_()
            layer.recurrent_states[0].zero_()
        return self.linear_out(x_branch * y_branch), None

    return block_forward


def _reorder_cache(cache, beam_idx):
    raise UnsupportedInputError(
        "beam search is not supported for RecurrentGemma under context parallelism: on one process transformers "
        "reorders its cache's attention layers with the beams but not the RG-LRU and convolution states on its "
        "modules, so each beam continues from another beam's state. Use greedy decoding or sampling."
    )


def apply(model):
    """Run the model's recurrent blocks through the cache's state API under a context-parallel cache; returns undo()."""
    module = sys.modules[type(model.get_decoder()).__module__]
    blocks = [
        (i, layer.temporal_block)
        for i, layer in enumerate(model.get_decoder().layers)
        if isinstance(layer.temporal_block, module.RecurrentGemmaRecurrentBlock)
    ]
    for i, block in blocks:
        setattr(block, _INDEX, i)
    undo_forward = install(module.RecurrentGemmaRecurrentBlock, "forward", _through_cache)
    model._reorder_cache = _reorder_cache  # generate() calls a model's own _reorder_cache when it has one
    handle = model.register_forward_pre_hook(_caller, with_kwargs=True)  # before the runtime's hook (installed later)

    def undo():
        handle.remove()
        undo_forward()
        del model._reorder_cache
        for _, block in blocks:
            delattr(block, _INDEX)

    return undo
