"""The input contract: what a patched model accepts, read once per call, and every refusal.

At apply (`check_model`) the model is checked against what the algorithms
implement; before each forward (`InputContract.read`) the caller's arguments become one checked
`Inputs` record and the cache the forward runs with (candidates.py refuses generate()'s candidate decoding where it
is not exact). Every
refusal raises a typed `ContextParallelError` (errors.py) from the arguments alone, before any
collective, so every rank given the same arguments refuses the same way.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicCache

from ..attention import own_index
from ..attention.masks import ones_only
from ..cache.sharded import (
    ShardedCache,
    cache_aliases,
    cache_argument,
    cache_recurrence,
    cache_windows,
    is_empty_cache,
    with_copies,
)
from ..errors import (
    CacheMismatchError,
    PackedSequenceError,
    PatchStateError,
    UnsupportedInputError,
    UnsupportedModelError,
)
from ..sparse import csa as sparse_csa
from .families import NOT_CHAINED, REGISTRY, hooks_of, refuse_inexact
from .families import resolve as resolve_family

_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}
_RECURRENT_LAYER_TYPES = {"linear_attention", "conv", "hybrid", "hybrid_sliding"}  # states passed down the chain
_STATELESS_LAYER_TYPES = {"moe", "mlp"}  # a block with neither K/V nor a state (Nemotron-H's)
_WHY = {  # why a layer kind is refused (transformers' layer_types names)
    "indexed_attention": "Indexed (DeepSeek-V3.2 DSA) attention keeps each query's top-k keys by an indexer's "
    "scores over all earlier tokens; hf-contextpar runs it exactly (every rank's indexer scores every column) "
    "for the families registered with an indexer it verified (patches/, `indexed=True`), not this one.",
    "compressed_sparse_attention": "DeepSeek-V4's compressed attention (CSA, HCA) "
    "runs exactly for the family registered with it (patches/, `compressed=True`), not this one.",
    "other": "Linear-attention, state-space, convolution and other recurrent layers carry a state along the "
    "sequence; hf-contextpar passes it between ranks only for mixers that read and write it through "
    "transformers' cache state API and continue a multi-token forward from it, as verified per family.",
}
_WHY["heavily_compressed_attention"] = _WHY["compressed_sparse_attention"]
_COMPRESSED = ("compressed_sparse_attention", "heavily_compressed_attention")  # DeepSeek-V4's (patches/deepseek_v4.py)
_COUNTED = ("hybrid", "hybrid_sliding", "indexed_attention", *_COMPRESSED)  # attention layers beside those above


def attention_layers(config) -> int:
    """Layers that attend over the sequence (a hybrid block's included); without `layer_types`, every layer but those
    a config lists as `cross_attention_layers`: they attend to another input's states, not over the sequence, and a
    text-only forward skips them (Mllama's; its family patch refuses cross-attention inputs). A layer the forward
    runs again through a copy of its cache layer (Dory's loops, `FamilyHooks.cache_copies`) counts once per run."""
    text = config.get_text_config(decoder=True)
    types = getattr(text, "layer_types", None)
    hooks = hooks_of(config)
    again = len(hooks.cache_copies(text))
    if not types:
        cross = set(getattr(text, "cross_attention_layers", None) or ())
        return text.num_hidden_layers - len(cross & set(range(text.num_hidden_layers))) + again
    indexed = hooks.indexed_layer_type()  # a family's own name for its indexed layers (MiniMax-M3's)
    return sum(t in _ATTENTION_LAYER_TYPES or t in _COUNTED or t == indexed for t in types) + again


def _indexes(layer) -> bool:
    """Does a transformers cache layer keep an indexer's keys (DSA's `update_indexer`, MiniMax-M3's per-layer
    `update_index`)? A cache without the model's such layers fails inside the model on one process."""
    return hasattr(layer, "update_indexer") or hasattr(layer, "update_index")


# -- the model, at apply ---------------------------------------------------------------------
def shared_attention_modules(model) -> list[str]:
    """Class names of the attention modules that serve several layers: no layer index of their own (`own_index`)."""
    named = (m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx"))
    return sorted({type(m).__name__ for m in named if own_index(m) is None})


def has_sinks(model) -> bool:
    """Do the model's attention modules hold learned sink logits (a `sinks` parameter, one per head: GPT-OSS's)?"""
    return any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in model.modules())


def check_model(model, sparse: bool = False):
    """The model's family patch, after refusing what the algorithms (sparse: CSA too) do not implement."""
    _refuse_wrapper(model)
    config = model.config
    refuse_inexact(config)  # the family's own reason first (a generic check below may trip on its structure)
    if sparse:
        sparse_csa.refuse_family(REGISTRY.get(config.model_type))
        sparse_csa.refuse_layers(config, sinks=has_sinks(model))
        sparse_csa.refuse_shared_modules(shared_attention_modules(model))
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            "encoder-decoder models are not supported: hf-contextpar shards decoder-only causal LMs."
        )
    text = config.get_text_config(decoder=True)
    layer_types = set(getattr(text, "layer_types", None) or [])
    kinds = layer_types - _ATTENTION_LAYER_TYPES - _STATELESS_LAYER_TYPES
    chained = kinds & _RECURRENT_LAYER_TYPES
    family = REGISTRY.get(config.model_type)
    if chained and family is not None and family.recurrent:  # its mixers continue from a passed state (verified)
        kinds -= chained
    if family is not None and family.indexed:  # its indexer scores every rank's index keys (attention/indexed.py)
        kinds -= {family.hooks.indexed_layer_type()}
    if family is not None and family.compressed:  # its compressors' state and entries pass between ranks (V4's)
        kinds -= set(_COMPRESSED)
    if kinds:
        why = " ".join(sorted({_WHY.get(k, _WHY["other"]) for k in kinds}))
        why = "" if config.model_type in NOT_CHAINED else why  # the family's own reason is the precise one
        hybrids = ", ".join(sorted(m for m, p in REGISTRY.items() if p.recurrent))
        also = f", and recurrent layers in the families verified to continue from a passed state ({hybrids})"
        blocks = f" ({NOT_CHAINED[config.model_type]})" if config.model_type in NOT_CHAINED else ""  # first: unclipped
        raise UnsupportedModelError(
            f"this model ({config.model_type}) has {sorted(kinds)} layers{blocks}; hf-contextpar supports softmax attention "
            f"layers (full, sliding-window or chunked){also if kinds & _RECURRENT_LAYER_TYPES else ''}. {why}".rstrip()
        )
    if getattr(text, "num_attention_heads", None) is None and not chained and not _states_alone(family, text):
        raise UnsupportedModelError(
            f"{type(model).__name__}'s config declares no attention heads (num_attention_heads): its layers are "
            "not softmax attention (a recurrence such as RWKV's), which hf-contextpar does not shard."
        )
    window = getattr(text, "sliding_window", None)
    if window is not None and window < 2 and (not layer_types or "sliding_attention" in layer_types):
        raise UnsupportedModelError(
            f"sliding_window={window}: each token would attend to itself only, and transformers' own cached decode "
            "differs from a full recompute there (its sliding cache keeps window - 1 = 0 tokens), so there is no "
            "single-process result to match. Use a window of at least 2."
        )
    # True (Gemma 3's flag) or "all" (Gemma 4 Unified's): every token attends to later ones; "vision" (Gemma 4
    # Unified's default) makes image tokens attend among themselves and leaves text causal, so a text model runs causal
    bidirectional = getattr(text, "use_bidirectional_attention", False)
    if bidirectional is True or bidirectional == "all":
        raise UnsupportedModelError(
            f"use_bidirectional_attention={bidirectional!r} makes every token attend to later tokens too; "
            "hf-contextpar's algorithms implement causal (and sliding-window causal) attention only."
        )
    # a causal LM that computes every row (xLSTM's forward takes no logits_to_keep and ignores one): rows kept alike
    if "logits_to_keep" not in inspect.signature(model.forward).parameters and model.get_output_embeddings() is None:
        raise UnsupportedModelError(
            f"{type(model).__name__}.forward has no logits_to_keep argument; load the model with AutoModelForCausalLM."
        )
    return resolve_family(config)


def _states_alone(family, config) -> bool:
    """A family verified to pass its states down the ranks whose cache (its hooks' `cache`) holds states alone: a
    recurrent model whose config lists no layer kinds (RWKV's, run through the cache by its patch)."""
    if family is None or not family.recurrent:
        return False
    return all(r.states and not r.kv for r in cache_recurrence(family.hooks.cache(config)))


def _refuse_wrapper(model):
    """A wrapper around the causal LM (torch.compile's, PEFT's) is not the module whose forward the library hooks:
    say which module to apply to, and in what order."""
    if isinstance(model, torch.nn.Module) and hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule":
        raise UnsupportedModelError(
            f"this is torch.compile's wrapper of {type(model._orig_mod).__name__}: apply context parallelism before "
            "compiling, model = torch.compile(hf_contextpar.apply_context_parallel(model)) (the compiled graph must "
            "contain the library's hooks and attention), or apply to the uncompiled model (compiled._orig_mod)."
        )
    base = getattr(model, "get_base_model", None)
    if callable(base) and base() is not model:
        raise UnsupportedModelError(
            f"this is a {type(model).__name__} (PEFT) wrapping {type(base()).__name__}: apply context parallelism to "
            "the causal LM inside it, hf_contextpar.apply_context_parallel(peft_model.get_base_model()), or before "
            "get_peft_model(); the PeftModel's forward and generate() then run through it exactly."
        )


# -- one forward -----------------------------------------------------------------------------
@dataclass
class Inputs:
    """A forward's inputs, checked: what the plan, the rank check and the output gather read."""

    ids: torch.Tensor | None
    embeds: torch.Tensor | None
    batch: int
    num_new: int
    cache: ShardedCache | None
    past: int
    mask: torch.Tensor | None  # the caller's 2D mask (batch, past + num_new)
    padding: torch.Tensor | None  # the mask as bool, None when it holds ones alone (masks.ones_only)
    position_ids: torch.Tensor  # (batch, num_new), global
    logits_to_keep: int | torch.Tensor
    output_hidden_states: bool | None
    as_tuple: bool  # the caller wants a tuple: the gathers read the output object, made a tuple after


class InputContract:
    """Reads a forward's arguments into `Inputs` for one patched model on one rank."""

    def __init__(self, model, rank: int, world: int, attention_name: str):
        self.model, self.rank, self.world = model, rank, world
        self.attention_name = attention_name
        self.hooks = hooks_of(model.config)  # what the family needs of the engine beyond its config (FamilyHooks)
        # the layers its forward adds to the cache as copies of its own (Dory's loops), made up front
        self.copies = tuple(self.hooks.cache_copies(model.config.get_text_config(decoder=True)))
        self.num_layers = model.config.get_text_config(decoder=True).num_hidden_layers + len(self.copies)
        # the sliding layers of the cache the unpatched model makes when given none (or the family keeps its states in)
        template = self.hooks.cache(model.config)
        self.windows = with_copies(cache_windows(template), self.copies)
        # per layer: the LayerMaker of its cache layer (K/V, states)
        self.recurrence = with_copies(cache_recurrence(template), self.copies)
        self.indexers = [_indexes(layer) for layer in template.layers]  # DSA's index keys
        if all(r.states and not r.kv for r in self.recurrence):  # recurrent layers alone (Mamba2): no attention
            self.attention_name = None
        # transformers' own list of models that take no DynamicCache (MiniMax keeps a cache class of its own)
        self.takes_dynamic = getattr(model, "_supports_default_dynamic_cache", lambda: True)()
        # hyper-connections (hc_mult streams): hidden states (B, T, hc, H), their token dim counted from the front
        self.streams = getattr(model.config.get_text_config(decoder=True), "hc_mult", None) is not None
        self.params = list(inspect.signature(model.forward).parameters)
        # the forward's cache argument, and the names a caller may pass it under (5.24 keeps the old one); a forward
        # that takes none (OpenAI GPT's, RWKV's) leaves a cache passed to it in its **kwargs, ignored on one process:
        # no name (the runtime passes the forward's own cache under cache_arg all the same, for its family patch)
        self.cache_arg = cache_argument(model)
        if self.cache_arg not in self.params:
            self.cache_names = ()
        else:
            self.cache_names = ("cache", *cache_aliases(model)) if self.cache_arg == "cache" else ("past_key_values",)

    def read(self, args, kwargs) -> tuple[dict, Inputs]:
        """(the forward's keyword arguments without the cache, its checked Inputs)."""
        kwargs = dict(kwargs)
        for name, value in zip(self.params, args):
            kwargs[name] = value
        self._refuse_options(kwargs)
        ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
        x = embeds if embeds is not None else ids
        if x is None:
            raise UnsupportedInputError("pass input_ids or inputs_embeds to the patched model.")
        batch, num_new = x.shape[0], x.shape[1]
        if num_new == 0:  # one process fails inside the model too
            raise UnsupportedInputError("the input holds no tokens (sequence length 0); pass at least one.")
        keep = kwargs.get("logits_to_keep", 0) if "logits_to_keep" in self.params else 0  # else ignored, as there
        if isinstance(keep, int) and keep < 0:  # outside transformers' documented "keep the last N rows"
            raise UnsupportedInputError(
                f"logits_to_keep={keep}: a negative int is not supported under context parallelism (models "
                "disagree on it: most keep the rows from -logits_to_keep on, Gemma 4 drops those rows twice); "
                "pass a 1D tensor of the row indices you want."
            )

        cache = self._resolve_cache(self._take_cache(kwargs), kwargs.get("use_cache"))
        past = cache.layout.seq_length if cache is not None else 0
        mask = kwargs.get("attention_mask")
        if mask is not None:
            self.hooks.check_mask(self.model, mask, num_new)
        position_ids = _checked_positions(
            kwargs.get("position_ids"), mask, cache, batch, num_new, past, x.device, self.attention_name is not None
        )
        return_dict = kwargs.get("return_dict")
        inputs = Inputs(
            ids=ids,
            embeds=embeds,
            batch=batch,
            num_new=num_new,
            cache=cache,
            past=past,
            mask=mask,
            padding=None if mask is None or ones_only(mask) else mask.bool(),  # None: ones alone
            position_ids=position_ids,
            logits_to_keep=keep,
            output_hidden_states=kwargs.get("output_hidden_states"),
            as_tuple=not (return_dict if return_dict is not None else getattr(self.model.config, "return_dict", True)),
        )
        return kwargs, inputs

    def _refuse_options(self, kwargs):
        """What a forward may ask that context parallelism does not give: a loss, attention weights, or another
        attention implementation than the one switched in at apply."""
        if self.model.training and torch.is_grad_enabled():
            raise UnsupportedInputError(
                f"{type(self.model).__name__} is in training mode with gradients enabled, but hf-contextpar is for "
                "inference only: its forward runs without autograd (the collectives between ranks are not "
                "differentiable), so no gradient would reach the weights and backward() would fail. Call "
                "model.eval() and run the forward under torch.no_grad() or torch.inference_mode(); to train, "
                "remove_context_parallel(model) first."
            )
        if kwargs.get("labels") is not None:
            raise UnsupportedInputError(
                "labels are not supported under context parallelism (inference only: the forward runs without "
                "autograd, so there is no loss to train on). To evaluate a loss, compute it under torch.no_grad() "
                "from the gathered logits (model(..., logits_to_keep=0).logits, identical on every rank), as "
                "transformers does: cross-entropy of logits[:, :-1] against input_ids[:, 1:]."
            )
        if kwargs.get("output_attentions"):
            raise UnsupportedInputError("output_attentions=True is not supported under context parallelism.")
        implementation = self.model.config._attn_implementation
        if (
            self.attention_name is not None and implementation != self.attention_name
        ):  # else each rank attends to its shard alone
            raise PatchStateError(
                f"the model's attention implementation is {implementation!r}, changed after apply_context_parallel; "
                "call remove_context_parallel(model), set the implementation, then apply again."
            )

    def new_cache(self) -> ShardedCache:
        return ShardedCache(self.num_layers, self.rank, self.world, self.windows, self.recurrence)

    def _take_cache(self, kwargs):
        """The caller's cache (removed from kwargs). Given under both names, transformers 5.24 takes
        `cache` and ignores `past_key_values` (with a warning): so does this."""
        present = [name for name in self.cache_names if name in kwargs]
        cache = kwargs[present[0]] if present else None
        for name in present:
            del kwargs[name]
        return cache

    def _resolve_cache(self, cache, use_cache):
        """The ShardedCache this forward runs with (None: no cache), or a refusal."""
        if use_cache is None:
            use_cache = getattr(self.model.config.get_text_config(decoder=True), "use_cache", True)
        if isinstance(cache, ShardedCache):
            if cache.layout.world != self.world or cache.layout.rank != self.rank:
                raise CacheMismatchError("this ShardedCache belongs to a different context-parallel group.")
            return cache
        if cache is None:
            return self.new_cache() if use_cache else None
        if type(cache) is DynamicCache and not self.takes_dynamic:  # one process refuses it
            raise CacheMismatchError(
                f"{type(self.model).__name__} takes no DynamicCache (transformers gives it a cache class of its own): "
                "pass no cache, then pass back the cache the patched model returned."
            )
        if type(cache) is DynamicCache and is_empty_cache(cache):
            if getattr(cache, "offloading", False):
                raise CacheMismatchError(
                    "an offloaded cache (cache_implementation='offloaded') is not supported under context "
                    "parallelism: each rank keeps its 1/N of the KV cache in a ShardedCache on its device. "
                    "Drop cache_implementation."
                )
            indexers = [_indexes(layer) for layer in cache.layers]
            recurrence = cache_recurrence(cache)
            if len(recurrence) + len(self.copies) == self.num_layers:
                recurrence = with_copies(recurrence, self.copies)
            if (any(r.states for r in self.recurrence) and recurrence != self.recurrence) or (
                any(self.indexers) and indexers != self.indexers
            ):  # one process fails inside the model (no layer to hold the states, or the index keys)
                raise CacheMismatchError(
                    "this model has recurrent or indexed-attention (DSA) layers, and the DynamicCache passed has not "
                    "the model's layers: pass DynamicCache(config=model.config), or no cache."
                )
            # generate()'s fresh default cache, or an empty one the caller keeps and passes again:
            # the object itself becomes the sharded cache, so the caller's reference carries the state
            return ShardedCache.bind(cache, self.num_layers, self.rank, self.world, self.recurrence, self.copies)
        if isinstance(cache, Cache):
            raise CacheMismatchError(
                f"a {type(cache).__name__} cannot be used under context parallelism: each rank keeps its own "
                "ShardedCache. Pass no cache or an empty DynamicCache() (generate()'s default) and pass back "
                "the cache the patched model returned (output.cache; output.past_key_values before transformers "
                "5.24); static, sliding-window (static), quantized and "
                "offloaded caches (cache_implementation other than 'dynamic') are not supported, nor a cache "
                "filled without context parallelism."
            )
        raise CacheMismatchError(f"unsupported cache (past_key_values) of type {type(cache).__name__}.")


def _is_packed(position_ids: torch.Tensor) -> bool:
    """transformers' rule (masking_utils.find_packed_sequence_indices): a row whose positions do not
    go up by exactly one holds several packed documents."""
    first = position_ids[:, :1] - 1
    return bool((torch.diff(position_ids, prepend=first, dim=-1) != 1).any())


def _checked_positions(position_ids, mask, cache, batch: int, num_new: int, past: int, device, attends=True):
    """The forward's global position ids (B, T), after refusing inputs whose mask the plan cannot
    reproduce: a 4D or wrongly sized mask, and packed documents."""
    if mask is not None and mask.dim() != 2:
        raise UnsupportedInputError(
            "hf-contextpar needs the 2D padding mask (batch, past + new tokens); got a "
            f"{mask.dim()}D attention_mask. Pass the tokenizer's attention_mask instead of a prepared mask."
        )
    if past and cache.layout.batch != batch:  # one process fails deep in torch (a cat or a broadcast)
        raise CacheMismatchError(
            f"the cache holds {cache.layout.batch} sequences but the input has {batch}; pass a cache made "
            "for this batch (or none), or reorder it with the cache's batch methods first."
        )
    # a model without attention layers (Mamba2) reads only the mask's last num_new columns, as one process does
    if mask is not None and (mask.shape[1] != past + num_new if attends else mask.shape[1] < num_new):
        again = (
            " (the input repeats the cached tokens: transformers' assisted and prompt-lookup decoding do "
            "that over a cache filled by an earlier call; start them with no cache)"
            if mask.shape[1] == num_new
            else ""
        )
        raise CacheMismatchError(
            f"attention_mask covers {mask.shape[1]} tokens but the cache holds {past} and the input adds "
            f"{num_new}; pass the mask for the whole sequence (past + new), as generate() does{again}."
        )
    if position_ids is None:
        return torch.arange(past, past + num_new, device=device).expand(batch, -1)
    if mask is None and cache is None and _is_packed(position_ids):
        raise PackedSequenceError(
            "these position_ids restart inside a row, which transformers reads as packed documents "
            "(a block-diagonal mask); hf-contextpar does not shard packed sequences. Run each document "
            "as its own row (with padding and an attention_mask), or pass an all-ones attention_mask if "
            "the jumps in position_ids are not document boundaries."
        )
    return position_ids.expand(batch, -1)
