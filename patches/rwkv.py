"""RWKV (v4): its time-mix and channel-mix states through the cache, so that they pass down the ranks.

transformers' RWKV keeps its states in a list of five (batch, hidden, layers) tensors it takes and returns as
`state=` (channel-mix shift, time-mix shift, the WKV numerator, denominator and running maximum), outside the Cache
API, and it has no attention at all. Each block's output over a span depends only on its inputs there and on that
block's states before the span: the shifts are the previous token's (normed) hidden state, a convolution of width 1,
and the WKV scan continues from its three sums. So under a context-parallel cache this patch runs every block from
states held in a transformers `LinearAttentionLayer` of its index, one per block with two states (`Hooks.cache`, the
cache the sharded one mirrors: conv 0 the time-mix shift, recurrent 0 the numerator and denominator, recurrent 1 the
maximum, conv 1 the channel-mix shift), and the state chain (hf_contextpar/cache/recurrent.py) passes them down the
ranks in a prefill: a chained rank continues from what rank - 1 left (its partitions hold 2 tokens or more, wider than
the shift). The block runs transformers' code unchanged, given a state list of its own for the span (`_span`), in the
dtypes its scan computes in, so a state crosses a rank unrounded (one process keeps it in its scan's variables there);
the caller's list is written once the final states are on every rank (`Hooks.finish`), as one process writes it: in
place when the caller passed one (`state=`, which its own tests pass back for a second turn), else into the list the
model made (use_cache).

Decode runs every block on every rank from the caller's list, as one process does. Refused: a mask with padding
(transformers' RWKV ignores attention_mask: padded tokens enter the state; its own tests skip padding), a one-token
forward of several rows with a state (one process mixes the rows there), beam search (transformers does not reorder
the state list with the beams).
"""

from __future__ import annotations

import functools
import sys
from contextvars import ContextVar

import torch
from transformers.cache_utils import Cache, LinearAttentionLayer

from hf_contextpar.cache.recurrent import ChainedStates, running_chain
from hf_contextpar.cache.states import load_states
from hf_contextpar.errors import CacheMismatchError, UnsupportedInputError
from hf_contextpar.model.families import FamilyHooks

from .wrapping import install

_run: ContextVar = ContextVar("hf_contextpar_rwkv_run", default=None)  # (cache, caller's state) of the running forward
_wants: ContextVar = ContextVar("hf_contextpar_rwkv_wants", default=True)  # the caller's forward returns a state


def _caller(module, args, kwargs):
    """Before the context-parallel runtime (which runs the model with a cache whatever use_cache says): does the
    caller's forward return a state? One process returns one when given one, or asked to by use_cache; a forward
    given one keeps the cache, so that its final states reach every rank."""
    names = ("input_ids", "attention_mask", "inputs_embeds", "state", "labels", "use_cache")
    given = dict(zip(names, args)) | kwargs
    use_cache = given.get("use_cache")
    if use_cache is None:
        use_cache = module.config.use_cache and not module.training
    wants = given.get("state") is not None or bool(use_cache)
    x = given.get("input_ids") if given.get("input_ids") is not None else given.get("inputs_embeds")
    if given.get("state") is not None and x is not None:
        _check_state(module, given["state"], x.shape[0])
    if wants and x is not None and x.shape[0] > 1 and x.shape[1] == 1:
        raise UnsupportedInputError(
            f"{type(module).__name__} mixes the rows of a batch in a one-token forward with a state: its time-mix and "
            "channel-mix broadcast the (batch, hidden) shift state against the (batch, 1, hidden) input into (batch, "
            "batch, hidden), so one process's batched decode is not each sequence's own and there is nothing exact to "
            "match. Decode one sequence per call (batch size 1), or run it with use_cache=False and no state."
        )
    _wants.set(wants)
    if wants and "use_cache" not in dict(zip(names, args)):
        kwargs = dict(kwargs, use_cache=True)
    return args, kwargs


def _check_state(model, state, rows: int) -> None:
    """A state list that does not fit the call, refused on every rank before any of them runs a block: one process
    fails inside a block there (writing a (rows, hidden) state into the list's slot), but under context parallelism
    only the first rank reads the caller's list in a prefill (the others start from what rank - 1 passes), so that
    rank alone would fail while its peers wait for its states."""
    want = (rows, model.config.hidden_size, model.config.num_hidden_layers)
    shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in state]
    if len(shapes) != 5 or any(shape != want for shape in shapes):
        raise CacheMismatchError(
            f"state= does not fit this call: {type(model).__name__} takes a list of five (batch, hidden_size, "
            f"num_hidden_layers) = {want} tensors for these {rows} sequences, got {shapes}. Pass the list a call over "
            "the same sequences returned (generate() with num_return_sequences or beams has no state for the rows it "
            "adds)."
        )


def _causal_lm(forward):
    @functools.wraps(forward)  # its signature stays the model's (apply reads logits_to_keep there)
    def causal_lm_forward(self, *args, past_key_values=None, **kwargs):
        if not isinstance(past_key_values, ChainedStates):  # one process, or outside a patched forward
            return forward(self, *args, **kwargs)
        kwargs["use_cache"] = _wants.get()  # the model makes the list it returns, unless given one (or none wanted)
        state = kwargs.get("state")
        token = _run.set((past_key_values, state))
        try:
            return forward(self, *args, **kwargs)
        finally:
            _run.reset(token)

    return causal_lm_forward


def _start(block, hidden, layer, state, received: bool):
    """The states block `layer` starts from, {index in the state list: (batch, hidden)}: what rank - 1 passed, else
    the caller's list, else a fresh one's (zeros, a maximum of -1e30, as transformers makes it)."""
    if received:
        wkv, top = layer.recurrent_states[0], layer.recurrent_states[1]
        return {
            0: layer.conv_states[1][..., 0],
            1: layer.conv_states[0][..., 0],
            2: wkv[..., 0],
            3: wkv[..., 1],
            4: top[..., 0],
        }
    if state is not None:
        return {k: state[k][:, :, block.layer_id] for k in range(5)}
    zeros = hidden.new_zeros(hidden.shape[0], hidden.shape[-1], dtype=torch.float32)
    return {0: zeros, 1: zeros, 2: zeros, 3: zeros, 4: zeros - 1e30}


def _span(block, hidden, start):
    """A state list for the block's span: its column holds `start`; the shifts in the hidden states' dtype, the WKV
    sums in the dtypes the scan computes them in (the maximum's from the decay's), so nothing the scan leaves rounds."""
    top = torch.promote_types(torch.float32, block.attention.time_decay.dtype)  # max(max + decay, key in fp32)
    sums = torch.promote_types(top, hidden.dtype)  # exp(of maxima) * sums + exp(...) * values
    dtypes = (hidden.dtype, hidden.dtype, sums, sums, top)
    shape = (hidden.shape[0], hidden.shape[-1], block.layer_id + 1)
    span = [hidden.new_zeros(shape, dtype=d) for d in dtypes]
    for k, t in start.items():
        span[k][:, :, block.layer_id] = t
    return span


def _through_cache(forward):
    @functools.wraps(forward)
    def block_forward(self, hidden, state=None, use_cache=False, output_attentions=False):
        run = _run.get()
        if run is None:
            return forward(self, hidden, state=state, use_cache=use_cache, output_attentions=output_attentions)
        cache, caller = run
        idx, chain = self.layer_id, running_chain()
        cache.get_conv_state(idx)  # a chained rank's first touch: rank - 1's states arrive here
        received = chain is not None and chain.receive
        span = _span(self, hidden, _start(self, hidden, cache.layers[idx], caller, received))
        hidden, span, attentions = forward(
            self, hidden, state=span, use_cache=True, output_attentions=output_attentions
        )
        col = slice(idx, idx + 1)
        conv = {(0, 0): span[1][:, :, col], (0, 1): span[0][:, :, col]}
        wkv = {(1, 0): torch.stack((span[2][:, :, idx], span[3][:, :, idx]), -1), (1, 1): span[4][:, :, col]}
        load_states(cache.layers[idx], {k: t.contiguous() for k, t in (conv | wkv).items()})  # rank + 1's, at leave
        return hidden, state, attentions

    return block_forward


class Hooks(FamilyHooks):
    """RWKV's states live in a cache of one two-state linear-attention layer per block under context parallelism, and
    its output returns them in `state`."""

    def cache(self, config):
        layers = [LinearAttentionLayer(number_of_states=2) for _ in range(config.num_hidden_layers)]
        return Cache(layers=layers)

    def finish(self, output, cache) -> None:
        state = getattr(output, "state", None)
        if state is None:
            return
        for idx, layer in enumerate(cache.layers):
            if not layer.is_recurrent_states_initialized[0]:
                continue
            wkv = layer.recurrent_states[0]
            state[0][:, :, idx] = layer.conv_states[1][..., 0]
            state[1][:, :, idx] = layer.conv_states[0][..., 0]
            state[2][:, :, idx] = wkv[..., 0]
            state[3][:, :, idx] = wkv[..., 1]
            state[4][:, :, idx] = layer.recurrent_states[1][..., 0]

    def check_mask(self, model, mask, num_new: int) -> None:
        if not bool(mask.bool().all()):
            raise UnsupportedInputError(
                f"{type(model).__name__} ignores attention_mask (transformers warns it is unused): a padded token "
                "enters its state as any other, so a padded batch is not what it would compute for each sequence "
                "alone. Pass sequences of one length without padding (or one sequence per call)."
            )


HOOKS = Hooks()


def _reorder_cache(cache, beam_idx):
    raise UnsupportedInputError(
        "beam search is not supported for RWKV under context parallelism: transformers does not reorder its state "
        "list with the beams, so each beam continues from another beam's state. Use greedy decoding or sampling."
    )


def apply(model):
    """Run the model's blocks through the context-parallel cache's states (when it runs with one); returns undo()."""
    module = sys.modules[type(model.get_decoder()).__module__]
    undos = [install(module.RwkvBlock, "forward", _through_cache), install(type(model), "forward", _causal_lm)]
    model._reorder_cache = _reorder_cache  # generate() calls a model's own _reorder_cache when it has one
    handle = model.register_forward_pre_hook(_caller, with_kwargs=True)  # before the runtime's hook (installed later)

    def undo():
        handle.remove()
        for u in reversed(undos):
            u()
        del model._reorder_cache

    return undo
