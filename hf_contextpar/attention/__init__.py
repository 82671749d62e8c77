"""The registry of attention algorithms and the adapter hf-contextpar registers with transformers.

`context_parallel_attention` is what every attention layer calls once the model is switched to
`attn_implementation="hf_contextpar"`. It looks up the running forward's `Step` (the plan being
executed, set by the runtime's forward pre-hook) and hands local Q, this rank's K/V block and
global columns to the plan's algorithm. The mask function passes the 2D padding mask through
untouched: masks are built inside the algorithms from global columns, never from HF's
local-length 4D masks.
"""

from __future__ import annotations

import functools
import math
import weakref
from contextvars import ContextVar

import torch

from ..cache.blocks import pack_kv
from ..errors import CacheMismatchError, PatchStateError, UnsupportedModelError
from ..plan.strategies import STRATEGIES
from . import bias, entries, indexed, latent, ulysses
from .kernels import acc_dtype
from .masks import Chunked
from .merge import merge_packed, pack_partial, with_sink
from .step import LayerKV

NAME = "hf_contextpar"
current_step: ContextVar = ContextVar("hf_contextpar_step", default=None)


def algorithm(name: str):
    """The function of strategy `name`: its record's (plan/strategies.py) file in this package, imported once."""
    return _load(STRATEGIES[name])


@functools.cache
def _load(strategy):
    return strategy.load()


def context_parallel_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, softcap=None, **kwargs
):
    """What every attention layer of a patched model calls: the running plan's algorithm over this rank's
    K/V block, in named phases (refuse, locate the cached K/V, the local block, the layer's geometry, run)."""
    step = current_step.get()
    key, value, extra = entries.split(step, module, key, value)  # a layer's own entries beside its K/V (V4's)
    _refuse(step, module, dropout)
    select, own_mask = indexed.layer_selection(step, module, attention_mask, kwargs.get("indices"), kwargs)
    _refuse_own_mask(module, own_mask, kwargs)
    expanded = _expansion(step, module, key, value)
    cached_k, cached_v = (expanded.cached_k, expanded.cached_v) if expanded is not None else (key, value)
    source = _source_layer(step, module, cached_k, cached_v)
    idx = _layer_index(step, module)
    idx = idx if idx is not None else source  # Zamba's and Zamba2's shared block, Dory's loops: the layer it updated
    step.attended.add(idx)
    step.sources.add(source % len(step.cache.layers) if step.cache is not None else source)  # Zamba2's: -1
    chunk = chunk_size(module)
    kv_local = _local_block(step, idx, source, cached_k, cached_v, chunk, sliding_window)
    step.kv_shapes[idx] = (kv_local.shape[0], kv_local.shape[2], kv_local.shape[4])  # for runahead
    width = max(query.shape[-1], value.shape[-1])
    kv = LayerKV(
        key_dim=cached_k.shape[-1] if cached_k.shape[-1] != cached_v.shape[-1] else None,
        expand=expanded.expand if expanded is not None else None,
        local=(key, value) if expanded is not None else None,
        width=width if key.shape[-1] != value.shape[-1] else None,
        out_dim=value.shape[-1] if value.shape[-1] < width else None,
    )
    call = step.at(idx, source, sinks=_sinks(step, module, kwargs.get("s_aux")), kv=kv)  # handed to the algorithm
    q = kv.pad(query)
    attn = dict(
        scale=scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1]),
        window=Chunked(chunk, step.left_padding) if chunk is not None else sliding_window,
        softcap=softcap,
        **({"select": select} if select is not None else {}),
        **_score_bias(step, module, kwargs.get("score_bias")),
    )
    if step.dcp is not None:  # DCP: every query head of this KV head, over this rank's slots; merged below
        heads = q.shape[1]
        q = _gather_heads(step.dcp, q)
        out, lse = algorithm(step.algorithm)(call.but(sinks=None), q, kv_local, **attn)
        out, lse = _merge_heads(call, q, out, lse, heads)
    elif extra is not None:  # the entries after the algorithm's (out, LSE), then the sinks below
        out, lse = entries.run(call, algorithm(step.algorithm), q, kv_local, attn, extra)
    else:
        out, lse = algorithm(step.algorithm)(call, q, kv_local, **attn)
    if out is None:  # no key visible for any row (only padding rows can be in that state)
        out = q.new_zeros(call.out_shape(q))
    elif call.sinks is not None and lse is not None:  # an algorithm without an LSE applied them at its merge
        out = with_sink(out, lse, call.sinks)
    if out.shape[-1] != value.shape[-1]:  # a padded head size (LayerKV.width)
        out = out[..., : value.shape[-1]]
    if out.dtype != query.dtype:  # outputs come in the accumulation dtype
        out = out.to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def _refuse(step, module, dropout):
    """What this attention cannot run exactly, whatever its inputs: outside a patched forward, dropout."""
    if step is None:
        raise PatchStateError(
            f"{type(module).__name__} ran hf_contextpar's attention outside a context-parallel forward: an inner "
            "module of a patched model (its decoder, model.model(...) or get_decoder()(...), or a layer) was called "
            "by itself, which would attend to one rank's share of the sequence. Call the patched *ForCausalLM "
            "model itself (model(...), model.forward(...) or model.generate(...)); for hidden states, "
            "model(..., output_hidden_states=True).hidden_states (gathered on every rank, as one process returns "
            "them). Or call hf_contextpar.remove_context_parallel(model) first."
        )
    if dropout:  # a training-mode module with attention_dropout > 0: one process would drop weights at random
        raise UnsupportedModelError(
            "attention dropout is not supported under context parallelism (inference only): call model.eval() "
            "or set the config's attention_dropout to 0."
        )


def _refuse_own_mask(module, attention_mask, kwargs):
    """A mask or score bias of the layer's own (`attention_mask`: what is left of the layer's mask once indexed
    attention took its own, `indexed.layer_selection`)."""
    foreign = attention_mask is not None and attention_mask.dim() != 2
    if foreign or kwargs.get("position_bias") is not None:
        # context_parallel_mask hands over None or the 2D padding mask: anything else is the model's own mask or
        # score bias (Doge's learned per-key bias), which the algorithms' global-column masks would drop
        raise UnsupportedModelError(
            f"{type(module).__name__} adds a score bias or mask of its own to its attention, which hf-contextpar's "
            "attention (masks built from each block's global columns) cannot take: this model cannot run exactly "
            "under context parallelism."
        )


def _sinks(step, module, sinks):
    """The layer's sink logits: per head (H,), or per query token and head (B, H, Tq: Inkling 2's, from each query's
    hidden state), which stay with this rank's queries: refused where the algorithm moves queries."""
    if sinks is not None and sinks.dim() > 1 and STRATEGIES[step.algorithm].moves_queries:
        raise UnsupportedModelError(
            f"{type(module).__name__}'s attention sinks are computed from each query token's hidden state, which "
            f"stay on the query's rank; the {step.algorithm!r} algorithm moves queries between ranks: use ring "
            "pass-KV, all-gather KV or KV-Runahead, and replicated decode (decode='replicated')."
        )
    return sinks


def _score_bias(step, module, fn) -> dict:
    """A family's score bias from global columns (attention/bias.py: ALiBi, a relative-position bias), handed as
    `score_bias=fn`: {"bias": the forward's ScoreBias}, or {} without one. DCP gathers its TP peers' query heads
    and CSA prunes blocks by scores without it: both refused with one; a bias held per query row (`fn.per_query`)
    is refused where the algorithm moves queries."""
    if fn is None:
        return {}
    if step.dcp is not None or step.sparse is not None:
        what = "decode_context_parallel (DCP)" if step.dcp is not None else "sparse=CSA(...)"
        raise UnsupportedModelError(
            f"{type(module).__name__} adds a score bias from positions (ALiBi or a relative-position bias), which "
            f"{what} does not apply: run it without {what}."
        )
    ulysses.check_bias(step.algorithm, module, fn)  # a bias over a key's every KV head
    if getattr(fn, "per_query", False) and STRATEGIES[step.algorithm].moves_queries:  # rows of this rank's queries
        raise UnsupportedModelError(
            f"{type(module).__name__}'s score bias is computed from each query token's hidden state (a relative bias "
            f"per query), which stays on the query's rank; the {step.algorithm!r} algorithm moves queries between "
            "ranks: use ring pass-KV, all-gather KV or KV-Runahead, and replicated decode (decode='replicated')."
        )
    return {"bias": bias.for_forward(step, fn)}


def _expansion(step, module, key, value):
    """A layer that attends with its `expand_kv` of what it cached (attention/latent.py: MLA's latent, DiffLlama's
    two value halves side by side): the record of that expansion, else None. An expansion may mix the KV heads
    (DiffLlama's does), so a strategy that splits them between ranks is refused, and CSA, which prunes plain blocks,
    is too (MLA is refused both ways at apply, from its config)."""
    expanded = latent.take(module)
    if expanded is None or not (_same_view(key, expanded.k) and _same_view(value, expanded.v)):
        return None
    if step.sparse is not None:  # CSA prunes and ranks plain K/V blocks; its reference attends them so
        raise UnsupportedModelError(
            f"sparse=CSA(...) prunes plain K/V blocks, but {type(module).__name__} (layer {module.layer_idx}) attends "
            "with an expansion of its cached K/V (expand_kv), which CSA does not define. Run it exact (leave sparse "
            "unset)."
        )
    ulysses.check_expansion(step.algorithm, module)
    return expanded


def _local_block(step, idx, source, cached_k, cached_v, chunk, sliding_window):
    """This rank's K/V block of the layer: the cache's (this forward's included), checked against the layer's
    window, else this forward's own (DCP: this rank's slots of it, as the cache would hold them)."""
    if step.cache is None:
        kv_local = pack_kv(cached_k, cached_v)
        if step.dcp is not None:
            held = torch.arange(kv_local.shape[3], device=kv_local.device) % step.dcp.world == step.dcp.rank
            kv_local = kv_local[:, :, :, held]
        return kv_local
    layer = step.cache.layers[source]
    if chunk is not None and (sliding_window is not None or layer.window not in (None, chunk)):
        raise CacheMismatchError(
            f"layer {idx} attends in chunks of {chunk} tokens but its cache keeps a window of {layer.window}: "
            "if you passed a cache, it was made for another config: pass none or DynamicCache(config=model.config)."
        )
    # a family may attend otherwise over its sliding cache layers (FamilyHooks.attends_window: Moshi's no window)
    if chunk is None and layer.window is not None and not step.family.attends_window(layer.window, sliding_window):
        raise CacheMismatchError(
            f"layer {idx}'s cache keeps a sliding window of {layer.window} tokens but its attention uses "
            f"sliding_window={sliding_window}. If you passed a cache, it was made for another config: pass none "
            "or DynamicCache(config=model.config). If you passed none, this model's attention disagrees with the "
            "cache its own config makes (DynamicCache(config=model.config)), so it cannot run exactly under "
            "context parallelism."
        )
    kv_local = layer.block()
    if not STRATEGIES[step.algorithm].stays_local:  # a message: the cache buffer itself when it holds just these
        kv_local = kv_local.contiguous()
    return kv_local


def _gather_heads(dcp, q: torch.Tensor) -> torch.Tensor:
    """DCP: the query heads of every rank sharing this KV head, in DCP rank order, which is the order of
    the TP plan's column shards: (B, dcp x heads, T, D)."""
    b, h, t, d = q.shape
    return dcp.all_gather(q).permute(1, 0, 2, 3, 4).reshape(b, dcp.world * h, t, d)


def _merge_heads(step, q, out, lse, heads: int):
    """DCP: the partial (out, LSE) of every query head over this rank's slots go to the head's owner (one
    all-to-all, a reduce-scatter of partials), which merges the peers' in DCP rank order: exact, and
    the same on every rank holding those heads' outputs."""
    dcp = step.dcp
    packed = pack_partial(None if out is None else (out, lse), step.out_shape(q), acc_dtype(q.dtype), q.device)
    send = [packed[:, i * heads : (i + 1) * heads] for i in range(dcp.world)]
    home = dcp.all_to_all(send, [send[dcp.rank].shape] * dcp.world)
    return merge_packed(torch.stack(home))


def chunk_size(module) -> int | None:
    """The chunk a chunked-attention layer (Llama 4's `attention_chunk_size`) attends within, else None. Read
    from the config once per module (transformers' config attributes cost microseconds each, and decode calls
    this per layer per token)."""
    try:
        return _chunks[module]
    except KeyError:
        chunk = _chunks[module] = _chunk_size(module)
        return chunk


_chunks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # attention module -> its chunk_size


def _chunk_size(module) -> int | None:
    config = getattr(module, "config", None)
    types = getattr(config, "layer_types", None) or ()
    idx = module.layer_idx
    if idx is not None and 0 <= idx < len(types) and types[idx] == "chunked_attention":
        return config.attention_chunk_size
    return None


def _source_layer(step, module, key, value) -> int:
    """The cache layer whose K/V these are, by an explicit mapping: the module's own layer; where a family shares KV
    across layers (Gemma 3n, Gemma 4), the layer its family hook names (`FamilyHooks.kv_source`); for a module
    shared by several layers, with no layer index of its own (Zamba's None, Zamba2's -1), or run again through a copy
    of its cache layer (Dory's loops), the cache layer the forward stored last (the one it just updated: the
    forward's stores are in order in its context). Then checked
    structurally: the K/V that layer's update returned in this forward, each layer attending once. Anything else is
    refused. Without a cache, a forward every rank runs whole ("local": fewer tokens than ranks) attends this
    forward's whole K/V, whichever layer calls: a shared module's call then counts as a layer of its own (-1, -2,
    ...), for `check_attended`'s count."""
    idx = _layer_index(step, module)
    stored = step.context.stored if step.cache is not None else None  # cache layer -> the K/V its update returned
    if idx is None and stored is None and step.algorithm == "local":
        return -1 - len(step.attended)
    if stored is None:
        source = idx
    elif idx is None:
        source = next(reversed(stored), None)
    else:
        shared = step.family.kv_source(module)
        source = idx if shared is None else shared
    handed = stored is None or (source is not None and _handed(stored.get(source), key, value))
    if (source if idx is None else idx) in step.attended or source is None or not handed:
        raise UnsupportedModelError(
            f"{type(module).__name__} (layer {idx}) calls attention with other keys or values than a cache layer "
            "returned in this forward, or more than once per forward: hf-contextpar takes each layer's K/V from "
            "its sharded cache, so this model cannot run exactly under context parallelism. Remove its "
            "hf_contextpar.patches.register() entry."
        )
    return source


def _layer_index(step, module) -> int | None:
    """The layer a call counts as: the module's own, or None for one that attends through the cache layer its forward
    stored last (`_source_layer`; Dory's loops: `FamilyHooks.looped`)."""
    return None if step.family is not None and step.family.looped(module) else own_index(module)


def own_index(module) -> int | None:
    """The module's own layer index; None for a module shared by several layers (Zamba's None, Zamba2's -1)."""
    idx = module.layer_idx
    return idx if idx is not None and idx >= 0 else None


def _handed(stored, key, value) -> bool:
    """The layer's cache was updated in this forward (`stored`: the K/V its update returned, else None) and these
    are those K/V (a second call for the layer is `Step.attended`'s to catch)."""
    return stored is not None and _same_view(key, stored[0]) and _same_view(value, stored[1])


def _same_view(a, b) -> bool:
    return a is b or (
        a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
    )


def context_parallel_mask(
    batch_size=None,
    q_length=None,
    kv_length=None,
    q_offset=None,
    kv_offset=None,
    mask_function=None,
    attention_mask=None,
    **kwargs,
):
    """Pass the 2D padding mask (B, global length) through; None when nothing is padded. A model with indexed
    attention gets its indexer's 4D mask instead (attention/indexed.py), which its attention hands back untouched."""
    step = current_step.get()
    if step is not None and step.indexed:
        return indexed.forward_mask(step, kwargs.get("device"))
    if step is not None and step.plan.padding is None:  # the input contract found the caller's mask unpadded
        return None
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return attention_mask


# transformers' own implementations of plain softmax attention (the model's eager one, SDPA, flash, flex): what the
# library's attention replaces exactly. Anything else a config names (a function a user registered with
# AttentionInterface, a hub kernel) may compute something else, which the replacement would silently drop.
SOFTMAX_IMPLEMENTATIONS = (
    "eager",
    "sdpa",
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
    "flex_attention",
)


def refuse_unknown_implementation(name) -> None:
    """At apply: refuse an attention implementation the library does not know to be plain softmax attention:
    a name outside transformers' own, or one of those names re-registered with a function of the user's."""
    from transformers import AttentionInterface

    function = AttentionInterface._global_mapping.get(name)
    own = function is None or getattr(function, "__module__", "").startswith("transformers.")
    if name is None or (name in SOFTMAX_IMPLEMENTATIONS and own):
        return
    what = (
        "is not one of transformers' softmax attentions"
        if name not in SOFTMAX_IMPLEMENTATIONS
        else (f"is registered with a function of your own ({getattr(function, '__qualname__', function)!r})")
    )
    raise UnsupportedModelError(
        f"the model's attention implementation {name!r} {what}. hf-contextpar replaces the attention with its own "
        f"exact context-parallel softmax attention, which would silently drop whatever {name!r} computes "
        "differently (a score scaling, a bias, sparsity). Load the model with one of "
        f"{', '.join(SOFTMAX_IMPLEMENTATIONS)} (attn_implementation=...), or run it on one process."
    )


def register() -> None:
    """Register with transformers' AttentionInterface and AttentionMaskInterface (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, context_parallel_attention)
    AttentionMaskInterface.register(NAME, context_parallel_mask)
