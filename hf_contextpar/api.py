"""apply_context_parallel / remove_context_parallel."""

from __future__ import annotations

import inspect

from . import attention
from .costmodel import ulysses_fits
from .distributed import DEFAULT_TIMEOUT_S, release_group, resolve_group
from .errors import ContextParallelError, UnsupportedModelError
from .runtime import ContextParallelRuntime
from .shm import open_shm_gather

STRATEGIES = ("auto", "ring_pass_kv", "ring_pass_q", "allgather_kv", "kv_runahead", "ulysses")
DECODES = ("auto", "replicated", "ring_pass_q")
_ATTR = "_hf_contextpar"
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}


def _check_model(model):
    from hf_contextpar import patches

    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            "encoder-decoder models are not supported: hf-contextpar shards decoder-only causal LMs."
        )
    text = config.get_text_config(decoder=True)
    layer_types = set(getattr(text, "layer_types", None) or [])
    if layer_types - _ATTENTION_LAYER_TYPES:
        raise UnsupportedModelError(
            f"this model has {sorted(layer_types - _ATTENTION_LAYER_TYPES)} layers; hf-contextpar supports only "
            "softmax attention layers (full or sliding window), not linear-attention, recurrent or chunked layers."
        )
    window = getattr(text, "sliding_window", None)
    if window is not None and window < 2 and (not layer_types or "sliding_attention" in layer_types):
        raise UnsupportedModelError(
            f"sliding_window={window}: each token would attend to itself only, and transformers' own cached decode "
            "differs from a full recompute there (its sliding cache keeps window - 1 = 0 tokens), so there is no "
            "single-process result to match. Use a window of at least 2."
        )
    if getattr(text, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            "use_bidirectional_attention=True makes every token attend to later tokens too; hf-contextpar's "
            "algorithms implement causal (and sliding-window causal) attention only."
        )
    if any(hasattr(m, "sinks") for m in model.modules()):
        raise UnsupportedModelError(
            "attention sinks (learned per-head sink logits) are not supported by hf-contextpar."
        )
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        raise UnsupportedModelError(
            f"{type(model).__name__}.forward has no logits_to_keep argument; load the model with AutoModelForCausalLM."
        )
    return patches.resolve(config)


def _check_ulysses(config, world: int):
    """Ulysses moves whole heads: N must divide the query heads and the KV heads (no KV head is repeated)."""
    text = config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if not ulysses_fits(heads, kv_heads, world):
        raise UnsupportedModelError(
            f"strategy='ulysses' splits attention heads over the {world} ranks, but this model has {heads} query "
            f"heads and {kv_heads} KV heads, which {world} does not divide. Use strategy='ring_pass_kv' (or any "
            f"other strategy), or a number of processes that divides {kv_heads}."
        )


def apply_context_parallel(
    model,
    *,
    strategy: str = "auto",
    group=None,
    timeout: float | None = None,
    check_inputs: bool = True,
    calibration=None,
    planner_rule: str = "cost",
    decode: str = "auto",
    kvr_partitions=None,
    kv_interleave: int = 1,
):
    """Patch `model` in place for context-parallel inference over `group` and return it.

    group: a torch.distributed process group; by default the one torchrun / accelerate set up
        (initialised here with gloo for CPU models, nccl for CUDA ones, if nobody has).
    strategy: prefill algorithm: "ring_pass_kv", "ring_pass_q", "allgather_kv", "kv_runahead",
        "ulysses", or "auto" to let the planner pick pass-KV or pass-Q per call from T, P and the
        machine's measured C and BW (Meta Alg. 5). KV-Runahead runs on fresh prompts; a partial
        prefill over a non-empty cache uses ring pass-KV. Ulysses needs N to divide the query and
        KV head counts.
    kvr_partitions: for "kv_runahead", a partition table (PartitionTable, dict or JSON path from
        `python -m hf_contextpar kvr-table`) to interpolate partitions from (KVR-P); None: even (KVR-E).
    calibration: a Calibration, a dict or a JSON path (default: the file `python -m hf_contextpar
        calibrate` saves, else built-in defaults). planner_rule: "cost" (the lower predicted time from
        the cost model), "alg5" (Meta Alg. 5) or "empirical" (App. D's h(T,P)).
    timeout: seconds any rank waits for its peers before failing with a clear error.
    decode: "replicated" (every rank computes each new token, sharded-KV attention), "ring_pass_q"
        (batched ring pass-Q decode, Meta Alg. 4: each rank runs ~B/N sequences), or "auto": batched
        pass-Q when the batch has at least one sequence per rank, replicated otherwise.
    kv_interleave: decode tokens whose K/V one rank stores before the next rank takes over (vLLM's
        cp_kv_cache_interleave_size): runs of k tokens, each started on the least-loaded rank, so
        shards stay within k tokens of each other. 1 (default): token by token.
    check_inputs: verify with one small all-gather per forward that every rank got the same inputs.
    On a single process this validates the model and changes nothing.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}.")
    if decode not in DECODES:
        raise ValueError(f"decode must be one of {DECODES}, got {decode!r}.")
    if isinstance(kv_interleave, bool) or not isinstance(kv_interleave, int) or kv_interleave < 1:
        raise ValueError(
            f"kv_interleave must be a positive int (decode tokens stored per rank before the next rank takes "
            f"over; 1 = token by token), got {kv_interleave!r}."
        )
    if getattr(model, _ATTR, None) is not None:
        raise ContextParallelError("context parallelism is already applied to this model.")
    family = _check_model(model)
    device = next(model.parameters()).device
    group, rank, world = resolve_group(group, device=device, timeout=timeout)
    if world == 1:
        return model
    try:
        if strategy == "ulysses":
            _check_ulysses(model.config, world)
        runtime = ContextParallelRuntime(
            model,
            group,
            rank,
            world,
            strategy=strategy,
            check_inputs=check_inputs,
            calibration=calibration,
            planner_rule=planner_rule,
            decode=decode,
            kvr_partitions=kvr_partitions,
            kv_interleave=kv_interleave,
        )
        _agree(runtime, group)
        runtime.comm.shm = open_shm_gather(group, rank, world, device, DEFAULT_TIMEOUT_S)
    except BaseException:
        release_group(group)  # a group made for this call only
        raise
    attention.register()
    runtime.original_attn = model.config._attn_implementation
    runtime.family_undo = family.apply(model) if family.apply is not None else None
    model.set_attn_implementation(attention.NAME)
    runtime.install()
    setattr(model, _ATTR, runtime)
    return model


def _agree(runtime, group):
    """Make every decision that changes which collectives run the same on every rank, once, here.

    Each rank's settings and model shape are compared (a mismatch is an error on every rank); the
    machine facts that drive per-call choices (the planner's calibration, KV-Runahead's partition
    table) are taken from rank 0, since each rank may have read a different file or none."""
    import torch.distributed as dist

    mine = dict(
        strategy=runtime.strategy,
        decode=runtime.decode,
        planner_rule=runtime.planner_rule,
        check_inputs=runtime.check_inputs,
        kv_interleave=runtime.kv_interleave,
        model=_model_signature(runtime.model),
    )
    everyone = [None] * runtime.world
    try:
        dist.all_gather_object(everyone, (mine, runtime.calibration, runtime.partitions), group=group)
    except RuntimeError as e:  # a peer that failed before this point (its own arguments) or timed out
        raise ContextParallelError(
            f"apply_context_parallel: a peer rank did not reach the agreement step ({e}). Every rank must call "
            "apply_context_parallel with the same arguments (its error on that rank says what was wrong)."
        ) from e
    for key in mine:
        values = [e[0][key] for e in everyone]
        if any(v != values[0] for v in values):
            raise ContextParallelError(
                f"apply_context_parallel got a different {key} on different ranks ({values}, by rank). Every rank "
                "must load the same model and call apply_context_parallel with the same arguments."
            )
    runtime.calibration, runtime.partitions = everyone[0][1], everyone[0][2]


def _model_signature(model):
    text = model.config.get_text_config(decoder=True)
    p = next(model.parameters())
    return (
        text.model_type,
        text.num_hidden_layers,
        text.num_attention_heads,
        getattr(text, "num_key_value_heads", None),
        getattr(text, "head_dim", None),
        text.vocab_size,
        str(p.dtype),
        sum(q.numel() for q in model.parameters()),
    )


def remove_context_parallel(model):
    """Undo `apply_context_parallel`: hooks removed, original attention restored. Returns the model."""
    runtime = getattr(model, _ATTR, None)
    if runtime is None:
        return model
    runtime.uninstall()
    model.set_attn_implementation(runtime.original_attn)
    if runtime.family_undo is not None:
        runtime.family_undo()
    delattr(model, _ATTR)
    runtime.comm.close_shm()
    release_group(runtime.comm.group)
    return model


def get_runtime(model) -> ContextParallelRuntime | None:
    """The runtime of a patched model (rank, world size, communication counters), or None."""
    return getattr(model, _ATTR, None)
