"""apply_context_parallel / remove_context_parallel."""

from __future__ import annotations

from . import attention
from .attention import latent
from .comm.agreement import agree_at_apply
from .comm.group import DEFAULT_TIMEOUT_S, release_group, resolve_group
from .comm.shm import open_shm_gather
from .errors import PatchStateError, UnsupportedModelError
from .mesh import dcp_of
from .model.contract import check_model
from .plan.strategies import STRATEGIES as STRATEGIES_BY_NAME
from .plan.strategies import prefill_names
from .runtime import ContextParallelRuntime

STRATEGIES = ("auto", *prefill_names())  # the values of strategy= (plan/strategies.py registers each)
DECODES = ("auto", "replicated", "ring_pass_q")
_ATTR = "_hf_contextpar"


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
    kvr_partitions: for "kv_runahead" (and the state chain of a model with recurrent layers), a partition
        table (PartitionTable, dict or JSON path from `python -m hf_contextpar kvr-table`) to interpolate
        partitions from (KVR-P); "balanced": partitions of equal work (later ranks, whose queries see more
        keys, take fewer tokens), from the cost model scaled to the ranks' measured compute in earlier
        prefills; "even" (KVR-E). None: balanced on a model with recurrent layers, else even. Every rank
        keeps 1/N of the KV cache whatever the partitions (the received K/V levels it).
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
    if strategy != "auto" and strategy not in prefill_names():
        raise ValueError(f"strategy must be one of {('auto', *prefill_names())}, got {strategy!r}.")
    if decode not in DECODES:
        raise ValueError(f"decode must be one of {DECODES}, got {decode!r}.")
    if isinstance(kv_interleave, bool) or not isinstance(kv_interleave, int) or kv_interleave < 1:
        raise ValueError(
            f"kv_interleave must be a positive int (decode tokens stored per rank before the next rank takes "
            f"over; 1 = token by token), got {kv_interleave!r}."
        )
    if getattr(model, _ATTR, None) is not None:
        raise PatchStateError("context parallelism is already applied to this model.")
    family = check_model(model)
    device = next(model.parameters()).device
    group, rank, world = resolve_group(group, device=device, timeout=timeout)
    if world == 1 and dcp_of(model) is None:  # with DCP one CP rank still shares its KV heads' tokens
        return model
    runtime = None
    try:
        if strategy != "auto" and STRATEGIES_BY_NAME[strategy].whole_heads:
            latent.refuse_ulysses(model)
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
        agree_at_apply(runtime, group)
        runtime.comm.shm = open_shm_gather(group, rank, world, device, DEFAULT_TIMEOUT_S)
        attention.register()
        runtime.original_attn = model.config._attn_implementation
        if runtime.contract.attention_name is not None:  # None: no attention layer at all (Mamba2's)
            model.set_attn_implementation(attention.NAME)
        if (
            model.config._attn_implementation != attention.NAME and runtime.contract.attention_name is not None
        ):  # the same model on every rank: all refuse
            raise UnsupportedModelError(
                f"{type(model).__name__} does not take an attention implementation from transformers' "
                "AttentionInterface (transformers keeps its own attention for it: it is not written against "
                "ALL_ATTENTION_FUNCTIONS), so hf-contextpar cannot put its attention in. This model cannot run "
                "under context parallelism."
            )
    except BaseException:
        if runtime is not None:
            runtime.comm.close_shm()
        release_group(group)  # a group made for this call only
        raise
    runtime.family_undo = family.apply(model) if family.apply is not None else None
    runtime.latent_undo = latent.install(model)
    runtime.install()
    setattr(model, _ATTR, runtime)
    return model


def remove_context_parallel(model):
    """Undo `apply_context_parallel`: hooks removed, original attention restored. Returns the model."""
    runtime = getattr(model, _ATTR, None)
    if runtime is None:
        return model
    runtime.uninstall()
    if runtime.contract.attention_name is not None:
        model.set_attn_implementation(runtime.original_attn)
    if runtime.family_undo is not None:
        runtime.family_undo()
    runtime.latent_undo()
    delattr(model, _ATTR)
    runtime.comm.close_shm()
    release_group(runtime.comm.group)
    return model


def get_runtime(model) -> ContextParallelRuntime | None:
    """The runtime of a patched model (rank, world size, communication counters), or None."""
    return getattr(model, _ATTR, None)
