"""xLSTM (NX-AI's xLSTM-7B): its mLSTM states through transformers' cache layers, so that they pass down the ranks.

Every xLSTM block is an mLSTM recurrence whose state per layer is three tensors (the matrix memory C, the normalizer
n, the max state m), kept in `xLSTMCache.rnn_state`, a plain class outside transformers' Cache API, so the state chain
(hf_contextpar/cache/recurrent.py) cannot see them. The family's hooks give the contract one transformers
`LinearAttentionLayer` of three recurrent states per block instead (`XlstmHooks.cache`), and under a
context-parallel cache this patch runs the model's blocks with their states read from and written to those layers
(`_model`, `_backend`): a chained rank continues from what rank - 1 left, decode from the states every rank took after
prefill. Any other cache (one process) runs transformers' forward untouched. Refused as one process fails them:
beam search (xLSTMCache has no reorder) and generate() over a cache passed back (its second turn is a forward over
the returned cache, model(new_ids, cache=out.cache), as on one process).

One process's arithmetic, kept as it is. Its inference backend (`wrap_chunkwise_arbitrary_sequence_length`) runs a
forward's tokens in whole chunks of `chunk_size` with the chunkwise kernel (in the model's dtype) and the rest, fewer
than `chunk_size` tokens, with the sequence kernel, whose state and outputs are cast to `inference_state_dtype`
(float32 by default, also in an fp64 model); a forward longer than `max_inference_chunksize` runs that per piece of
that many tokens, the states kept in the cache's dtype in between. So the kernel a token runs on depends on where
the forward's tokens start, not on the rank's: run naively on each rank's partition, a token one process runs
chunkwise in fp64 would run through the float32 sequence kernel (3e-7 in fp64 logits at N = 2, 200 tokens). Here each
rank runs each of its tokens with the kernel one process runs it with (`_pieces`): the chunkwise kernel on the
chunk grid of one process, a chunk that a rank boundary cuts as a chunk of its own (the same sum over the same
terms: fp64 rounding apart), the sequence kernel on one process's tail tokens. fp32 tails included, that is one
process's result to fp64 rounding.

Between forwards one process keeps the states in its cache's dtype (the model's): read again, they are cast to it; a
state passed down the ranks inside a forward is not (one process does not store it there). The states are stored in
the wider of the model's and the state dtype, which holds every value the kernels return. Given no cache and
use_cache=False over more than max_inference_chunksize tokens, one process keeps the states between its pieces in a
cache it makes for them, of xLSTMCache's default bfloat16: so do the ranks (`_caller`). Not reproduced: a bfloat16
model's chunkwise kernel run from a state another rank passed (one process keeps that state in the kernel's
bfloat16; the chain passes the stored float32 copy).
"""

from __future__ import annotations

import sys
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, LinearAttentionLayer

from hf_contextpar.cache.recurrent import ChainedStates, running_chain
from hf_contextpar.cache.sharded import cache_aliases
from hf_contextpar.errors import UnsupportedInputError, UnsupportedModelError
from hf_contextpar.model.families import FamilyHooks

from .wrapping import install

STATES = 3  # C (batch, heads, qk_head_dim, v_head_dim), n (batch, heads, qk_head_dim), m (batch, heads, 1)
_INDEX = "_hf_contextpar_layer_idx"  # an mLSTM backend's block index (its cache layer), set by apply
_running: ContextVar = ContextVar("hf_contextpar_xlstm_forward", default=None)  # the running `_Forward`
_fresh: ContextVar = ContextVar("hf_contextpar_xlstm_fresh", default=False)  # the caller: no cache, use_cache off


def _caller(module, args, kwargs):
    """Before the context-parallel runtime (which runs the model with its cache): did the caller pass no cache and
    turn use_cache off, as one process then runs the model?"""
    use = kwargs.get("use_cache")
    use = module.config.use_cache if use is None else use
    # the names its forward takes a cache under (cache, and the alias cache_params): past_key_values is not one of
    # them, and one process ignores it (it lands in **kwargs), making its own bfloat16 cache for the pieces
    given = any(kwargs.get(name) is not None for name in ("cache", *cache_aliases(type(module))))
    _fresh.set(not use and not given)


@dataclass(frozen=True)
class _Forward:
    """One model forward under a context-parallel cache, as its mLSTM backends read it."""

    cache: object  # the ShardedCache
    pieces: tuple  # `_pieces` of this rank's tokens
    dtype: torch.dtype  # the model's (inputs_embeds'): what one process's cache keeps the states in
    between: torch.dtype  # what one process keeps them in between its pieces of max_inference_chunksize tokens


def _pieces(start: int, stop: int, total: int, chunk: int, segment: int) -> tuple:
    """How one process runs the tokens [start, stop) of a forward of `total`: (lo, hi, kernel, chunk size, new
    segment), positions relative to `start`, in order. One process cuts the forward into segments of `segment`
    tokens, runs each segment's whole chunks with the chunkwise kernel and its last tokens with the sequence kernel
    (a 1-token segment with the step kernel), and keeps the states in its cache between segments (new segment)."""
    out = []
    for s in range(0, total, segment):
        e = min(s + segment, total)
        if e <= start or s >= stop:
            continue
        grid = s + chunk * ((e - s) // chunk)  # the end of the segment's whole chunks
        regions = [(s, e, "step")] if e - s == 1 else [(s, grid, "chunk"), (grid, e, "sequence")]
        first = s > 0 and s >= start  # this rank starts the segment: one process read the state from its cache
        for lo, hi, kernel in regions:
            lo, hi = max(lo, start), min(hi, stop)
            if lo >= hi:
                continue
            if kernel != "chunk":
                out.append((lo, hi, kernel, hi - lo, first))
                first = False
                continue
            up, down = s + -(-(lo - s) // chunk) * chunk, s + (hi - s) // chunk * chunk  # grid points inside
            cuts = [lo, *sorted({min(max(up, lo), hi), min(max(down, lo), hi)}), hi]
            for a, b in zip(cuts, cuts[1:]):
                if a < b:  # a cut chunk runs as a chunk of its own; whole chunks on one process's grid
                    out.append((a, b, kernel, chunk if (a - s) % chunk == 0 and (b - a) % chunk == 0 else b - a, first))
                    first = False
    return tuple((lo - start, hi - start, kernel, size, first) for lo, hi, kernel, size, first in out)


def _span(cache, tokens: int) -> tuple[int, int, int]:
    """(start, stop, total): this rank's tokens among the forward's new tokens (all of them unless chained)."""
    context = cache.context
    plan = context.plan if context is not None else None
    if plan is None or not plan.chained:
        return 0, tokens, tokens
    rows = plan.shards.token_rows[context.rank]
    return int(rows[0]), int(rows[0]) + tokens, plan.num_new


def _model(forward):
    def xlstm_model_forward(self, input_ids=None, inputs_embeds=None, cache=None, use_cache=None, **kwargs):
        if not isinstance(cache, ChainedStates):  # one process: transformers' forward, called as it was
            given = dict(input_ids=input_ids, inputs_embeds=inputs_embeds, cache=cache, use_cache=use_cache)
            return forward(self, **{k: v for k, v in given.items() if v is not None}, **kwargs)
        hidden = kwargs.get("output_hidden_states")
        hidden = self.config.output_hidden_states if hidden is None else hidden
        if not isinstance(hidden, bool):
            raise UnsupportedInputError(
                f"output_hidden_states={hidden!r}: under context parallelism xLSTM returns all hidden states "
                "(True) or none (False); select the ones you want from the tuple."
            )
        if kwargs.get("return_dict", getattr(self.config, "return_dict", True)) is False:  # before the chain starts
            raise UnsupportedInputError(
                "config.return_dict=False: xLSTMForCausalLM's forward fails on one process with it too (its backbone "
                "then returns a tuple, which has no .cache). Set config.return_dict = True; pass return_dict=False to "
                "a call for a tuple."
            )
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        x = self.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        start, stop, total = _span(cache, x.shape[1])
        config = self.config
        segment = config.max_inference_chunksize
        segment = segment if not self.training and segment < total and not hidden else total
        pieces = _pieces(start, stop, total, config.chunk_size, segment)
        # given no cache and use_cache off, one process makes one for its pieces: xLSTMCache's default bfloat16
        token = _running.set(_Forward(cache, pieces, x.dtype, torch.bfloat16 if _fresh.get() else x.dtype))
        states = []
        try:
            for block in self.blocks:
                states.append(x)
                x, _ = block(x, None)
        finally:
            _running.reset(token)
        x = self.out_norm(x)
        output = sys.modules[type(self).__module__].xLSTMOutput
        # as transformers' capture_outputs gives them: each block's input, then the normed output
        return output(last_hidden_state=x, cache=cache, hidden_states=(*states, x) if hidden else None)

    return xlstm_model_forward


def _backend(forward):
    def xlstm_backend_forward(self, query, key, value, igate, fgate, *args, **kwargs):
        run = _running.get()
        if run is None or getattr(self, _INDEX, None) is None:
            return forward(self, query, key, value, igate, fgate, *args, **kwargs)
        idx, cache = getattr(self, _INDEX), run.cache
        chain = running_chain()
        received = chain is not None and chain.receive  # rank - 1's states, passed inside this forward
        state = tuple(cache.get_recurrent_state(idx, i) for i in range(STATES))  # a chained rank receives them here
        if state[0] is None or state[0].shape[0] != query.shape[0]:  # xLSTMCache's zeros
            b, h, t, dk = query.shape
            shapes = ((b, h, dk, value.shape[-1]), (b, h, dk), (b, h, 1))
            state = tuple(torch.zeros(s, dtype=run.dtype, device=query.device) for s in shapes)
        elif not received:  # kept by one process's cache between forwards: in its dtype
            state = tuple(t.to(run.dtype) for t in state)
        h, state = _scan(self, run, (query, key, value, igate, fgate), state)
        kept = torch.promote_types(run.dtype, getattr(torch, self.config.inference_state_dtype))
        for i, t in enumerate(state):
            cache.update_recurrent_state(t.to(kept), idx, i)
            cache.layers[idx].has_previous_state[i] = True
        return h, state

    return xlstm_backend_forward


def _scan(backend, run: _Forward, qkvif: tuple, state: tuple):
    """The rank's tokens through the backend's own kernels, each piece with the one one process runs it with."""
    kernels = backend._inference_fn.keywords
    eps, outs = kernels["eps"], []
    for lo, hi, kernel, size, segment in run.pieces:
        if segment:  # one process read this segment's state from its cache
            state = tuple(t.to(run.between) for t in state)
        q, k, v, i, f = (x[:, :, lo:hi].contiguous() for x in qkvif)
        c, n, m = state
        if kernel == "step":
            h, state = kernels["mlstm_step_kernel"](
                query=q.squeeze(2), key=k.squeeze(2), value=v.squeeze(2), igate=i, fgate=f,
                cstate=c, nstate=n, mstate=m, eps=eps,
            )  # fmt: skip
            h = h[:, :, None, :]
        elif kernel == "sequence":
            h, state = kernels["mlstm_sequence_kernel"](
                query=q, key=k, value=v, igate=i, fgate=f,
                c_initial=c, n_initial=n, m_initial=m, return_last_states=True, eps=eps,
            )  # fmt: skip
        else:
            h, state = kernels["mlstm_chunkwise_kernel"](
                query=q, key=k, value=v, fgate=f, igate=i, c_initial=c, n_initial=n, m_initial=m,
                chunk_size=size, return_last_states=True, autocast_kernel_dtype=kernels["autocast_kernel_dtype"],
                eps=eps,
            )  # fmt: skip
        outs.append(h)
    return torch.cat(outs, 2), state


class XlstmHooks(FamilyHooks):
    """xLSTM keeps its states in xLSTMCache: the contract's cache holds them in transformers' layers instead."""

    def cache(self, config):
        text = config.get_text_config(decoder=True)
        return Cache(layers=[LinearAttentionLayer(number_of_states=STATES) for _ in range(text.num_hidden_layers)])


HOOKS = XlstmHooks()


def check(config) -> None:
    """What one process does not run from a passed state: the training backends and the external package's blocks."""
    mode = getattr(config, "mode", "inference")  # xLSTMConfig's default
    if mode != "inference":
        raise UnsupportedModelError(
            f"xLSTM's mode={mode!r} runs the chunkwise kernel over the whole sequence (a multiple of "
            "chunk_size, or padded to one), with no state to continue from; under context parallelism use "
            "mode='inference' (the config's default, what generation needs)."
        )


def _reorder_cache(cache, beam_idx):
    raise UnsupportedInputError(
        "beam search is not supported for xLSTM under context parallelism: transformers refuses it on one process "
        "too (its xLSTMCache cannot be reordered with the beams), so there is no result to match. Use greedy "
        "decoding or sampling."
    )


def _given_cache(prepare):
    def prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs):
        if model_kwargs.get("cache") is not None:
            raise UnsupportedInputError(
                "generate() over a cache passed back is not supported for xLSTM under context parallelism: on one "
                "process transformers' generate() fails there too ('xLSTMCache' object has no attribute "
                "'is_compileable'), so there is no result to match. Continue with forwards over the returned cache "
                "(model(new_ids, cache=out.cache)), as one process does."
            )
        return prepare(generation_config, model_kwargs, *args, **kwargs)

    return prepare_cache_for_generation


def apply(model):
    """Run the model's blocks through the context-parallel cache's state API; returns undo()."""
    module = sys.modules[type(model.get_decoder()).__module__]
    if getattr(module, "external_xlstm", False):
        raise UnsupportedModelError(
            "the `xlstm` package is installed, so transformers builds xLSTM's blocks from it (mLSTMBlock), whose "
            "kernels hf-contextpar does not run from a passed state; uninstall it to use transformers' own blocks."
        )
    backends = [block.mlstm_layer.mlstm_backend for block in model.get_decoder().blocks]
    for i, backend in enumerate(backends):
        setattr(backend, _INDEX, i)
    undos = [install(module.xLSTMModel, "forward", _model), install(module.xLSTMBackend, "forward", _backend)]
    model._reorder_cache = _reorder_cache  # generate() calls a model's own _reorder_cache when it has one
    model._prepare_cache_for_generation = _given_cache(model._prepare_cache_for_generation)  # every generate() call
    handle = model.register_forward_pre_hook(_caller, with_kwargs=True)  # before the runtime's hook (installed later)

    def undo():
        handle.remove()
        for u in undos:
            u()
        del model._reorder_cache
        del model._prepare_cache_for_generation
        for backend in backends:
            delattr(backend, _INDEX)

    return undo
