"""apply_context_parallel / remove_context_parallel.

Applying is one sequence of steps, each pushing its undo onto the runtime's stack (`Undo`);
removing pops them all, so `remove_context_parallel` is the exact inverse of what ran, and an
apply that fails half-way undoes what it did before raising.
"""

from __future__ import annotations

import warnings
import weakref

from . import attention
from .attention import latent
from .comm.agreement import agree_settings
from .comm.group import DEFAULT_TIMEOUT_S, release_dropped, release_group, resolve_group
from .comm.shm import open_shm_gather
from .errors import PatchStateError, UnsupportedModelError
from .mesh import dcp_of, tensor_parallel
from .model.contract import check_model
from .plan.strategies import prefill_names
from .runtime import ContextParallelRuntime
from .settings import DECODES, Settings

STRATEGIES = ("auto", *prefill_names())  # the values of strategy= (plan/strategies.py registers each)
__all__ = ["DECODES", "STRATEGIES", "apply_context_parallel", "get_runtime", "remove_context_parallel"]
_ATTR = "_hf_contextpar"


class Undo(list):
    """What apply did, as undo callables in the order it did it; `run()` undoes them last first."""

    def run(self):
        while self:
            self.pop()()


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
    partitions=None,
    kv_interleave: int = 1,
    sparse=None,
    kvr_partitions=None,
):
    """Patch `model` in place for context-parallel inference over `group` and return it.

    group: a torch.distributed process group; by default the one torchrun / accelerate set up
        (initialised here with gloo for CPU models, nccl for CUDA ones, if nobody has).
    strategy: prefill algorithm: "ring_pass_kv", "ring_pass_q", "allgather_kv", "kv_runahead",
        "ulysses", or "auto" to let the planner pick pass-KV or pass-Q per call from T, P and the
        machine's measured C and BW (Meta Alg. 5). KV-Runahead runs on fresh prompts; a partial
        prefill over a non-empty cache uses ring pass-KV. Ulysses needs N to divide the query and
        KV head counts.
    partitions: the contiguous partitions of "kv_runahead", CSA (sparse=) and the state chain of a model with
        recurrent layers (kvr_partitions, its former name, is still accepted with a DeprecationWarning): a partition
        table (PartitionTable, dict or JSON path from `python -m hf_contextpar kvr-table`) to interpolate
        partitions from (KVR-P); "balanced": partitions of equal work (later ranks, whose queries see more
        keys, take fewer tokens), from the cost model scaled to the ranks' measured compute in earlier
        prefills (the default, None; CSA's count the keys its pruning keeps); "even" (KVR-E), only when asked.
        Every rank keeps 1/N of the KV cache whatever the partitions (the received K/V rebalances it), but under CSA,
        whose K/V travel pruned, each rank keeps its own partition. CSA's answer depends on them (placement
        decides levels): `get_runtime(model).partitions(T)` says what the next prefill cuts.
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
    sparse: an approximate mode, opt in: `hf_contextpar.sparse.CSA(keep=..., topology=...)` runs fresh prefills
        with CSPS's communication-efficient sparse attention (earlier partitions' K/V pruned by distance and
        importance before they travel: NOT the one-process result, see docs/csa.md); later turns and decode stay
        exact. `get_runtime(model).approximate` counts the forwards that ran it. None (default): exact.
    On a single process this validates the model and changes nothing.
    """
    if getattr(model, _ATTR, None) is not None:
        raise PatchStateError("context parallelism is already applied to this model.")
    device = next(model.parameters()).device
    settings = Settings.of(
        strategy=strategy,
        decode=decode,
        planner_rule=planner_rule,
        check_inputs=check_inputs,
        kv_interleave=kv_interleave,
        partitions=_renamed(partitions, kvr_partitions),
        calibration=calibration,
        sparse=sparse,
    )
    family = check_model(model, sparse=settings.sparse is not None)
    group, rank, world = resolve_group(group, device=device, timeout=timeout)
    if world == 1 and dcp_of(model) is None:  # with DCP one CP rank still shares its KV heads' tokens
        return model
    try:
        settings = agree_settings(
            settings.resolved(device.type, world), model, group, tensor_parallel(model), dcp_of(model)
        )
        runtime = ContextParallelRuntime(model, group, rank, world, settings)
    except BaseException:
        release_group(group)  # a group made for this call only
        raise
    _install(model, runtime, family, device)
    return model


def _renamed(partitions, kvr_partitions):
    """partitions=, or kvr_partitions= (its name before it governed CSA's and the recurrent chain's partitions too)."""
    if kvr_partitions is None:
        return partitions
    if partitions is not None:
        raise ValueError("give partitions= only (kvr_partitions= is its former name), not both.")
    warnings.warn(
        "apply_context_parallel(kvr_partitions=...) is now partitions=...; the old name will be removed.",
        DeprecationWarning,
        stacklevel=3,
    )
    return kvr_partitions


def _install(model, runtime, family, device):
    """Every step that changes the model, each pushing its undo (`Undo`): a step that fails undoes the earlier."""
    comm = runtime.comm
    # the group is reached through the runtime's Comm, which drops it at exit (comm/group.release_at_exit): an
    # undo holding the group itself would keep a patched model's group, and gloo's threads, alive into finalization
    undo = Undo([lambda: release_group(runtime.comm.group)])
    try:
        comm.shm = open_shm_gather(comm.group, comm.rank, comm.world, device, DEFAULT_TIMEOUT_S)
        undo.append(comm.close_shm)
        # a family's patch first: it may be what lets the model take an attention implementation (patches/ported.py)
        if family.apply is not None:
            undo.append(family.apply(model))
        _switch_attention(model, runtime, undo)
        undo.append(latent.install(model))
        runtime.install()
        undo.append(runtime.uninstall)
        setattr(model, _ATTR, runtime)
        undo.append(lambda: delattr(model, _ATTR))
    except BaseException:
        undo.run()
        raise
    runtime.undo = undo
    # dropped without remove_context_parallel (a loop over checkpoints): its group and shared memory go with it
    finalizer = weakref.finalize(model, release_dropped, comm)
    finalizer.atexit = False  # at exit, comm/group.release_at_exit tears everything down
    undo.append(finalizer.detach)


def _switch_attention(model, runtime, undo: Undo):
    """Register the library's attention and switch the model to it (a model without attention layers,
    Mamba2's, keeps its own); refused where the model does not take it."""
    attention.register()
    if runtime.patched.contract.attention_name is None:
        return
    original = model.config._attn_implementation
    attention.refuse_unknown_implementation(original)
    model.set_attn_implementation(attention.NAME)
    undo.append(lambda: model.set_attn_implementation(original))
    if model.config._attn_implementation != attention.NAME:  # the same model on every rank: all refuse
        raise UnsupportedModelError(
            f"{type(model).__name__} does not take an attention implementation from transformers' "
            "AttentionInterface (transformers keeps its own attention for it: it is not written against "
            "ALL_ATTENTION_FUNCTIONS), so hf-contextpar cannot put its attention in. This model cannot run "
            "under context parallelism."
        )


def remove_context_parallel(model):
    """Undo `apply_context_parallel`, step by step in reverse: hooks removed, the family's patch and the
    original attention restored, shared memory closed, a group made for the model released."""
    runtime = getattr(model, _ATTR, None)
    if runtime is not None:
        runtime.undo.run()
    return model


def get_runtime(model) -> ContextParallelRuntime | None:
    """The runtime of a patched model (rank, world size, communication counters), or None."""
    return getattr(model, _ATTR, None)
