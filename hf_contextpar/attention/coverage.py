"""Every attention layer of a patched model goes through the library's attention, checked per forward.

A layer whose forward calls an attention function itself (SDPA, a KV-compression or research patch of the
attention forward) attends to this rank's shard of the sequence alone: its output would be wrong. The
adapter records the layers it ran (`Step.attended`) and the cache layers they attended (`Step.sources`);
the runtime's forward hook calls `check_attended` before any output leaves the forward, and turns a failure
inside transformers' own attention functions into the same error (`bypass_error`). A failure raised in the
library's own code is never relabelled: it propagates as itself (a bug of ours, not the user's bypass).
"""

from __future__ import annotations

import os

from ..errors import UnsupportedModelError


def check_attended(model, step, expected: int) -> None:
    """Every attention layer went through the library's attention once in this forward, and every cache layer
    whose K/V this forward updated was attended through it. The same code runs on every rank, so every rank
    raises alike. Costs two set sizes per forward."""
    missed = [] if step.cache is None else [i for i in sorted(step.context.stored) if i not in step.sources]
    if len(step.attended) == expected and not missed:
        return
    names = [
        f"{name} ({type(m).__name__}, layer {m.layer_idx})"
        for name, m in model.named_modules()
        if type(m).__name__.endswith("Attention") and getattr(m, "layer_idx", None) not in step.attended | {None}
    ]
    prefix = f"{len(step.attended)} of this model's {expected} attention layers ran hf-contextpar's attention; "
    raise UnsupportedModelError(prefix + _bypass_message(names or [f"cache layer(s) {missed}"]))


def bypass_error(tb, attended=frozenset()) -> UnsupportedModelError | None:
    """The error for a forward that failed in an attention layer that bypassed the library and met this rank's
    shard: inside one of transformers' own attention functions, or in the forward of an attention module that had
    not reached the library's attention in this forward (`attended`: the layers that had; a forward patched to
    call torch's SDPA itself). None where neither, or where the library's own code raised it (`tb` starts at the
    frame that caught it: the frames after it are the forward's)."""
    if _raised_in_library(tb.tb_next if tb is not None else None):
        return None
    where = _other_attention(tb) or _unreached_layer(tb, attended)
    return None if where is None else UnsupportedModelError(_bypass_message([where]))


def _raised_in_library(tb) -> bool:
    """The failure passed through a frame of the library (the engine or a family patch; not the eval harness, whose
    fp64 wrappers of torch functions run inside any layer): a library error, which the user must see as it is, not
    as their layer bypassing the library (a crash in the cache's indexer exchange once read as the user's fault)."""
    while tb is not None:
        module = tb.tb_frame.f_globals.get("__name__", "")
        if module.startswith("hf_contextpar.") and not module.startswith("hf_contextpar.eval."):
            return True
        tb = tb.tb_next
    return False


def _unreached_layer(tb, attended) -> str | None:
    """The innermost attention module (a module named *Attention with a layer_idx) whose forward the failure
    passed through, if the library's attention was not on the way and that layer had not run it yet."""
    found = None
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "context_parallel_attention":
            return None
        owner = frame.f_locals.get("self")
        idx = getattr(owner, "layer_idx", None)
        if type(owner).__name__.endswith("Attention") and idx is not None and idx not in attended:
            found = f"{type(owner).__name__} (layer {idx}), which failed before reaching it"
        tb = tb.tb_next
    return found


def _bypass_message(where: list) -> str:
    return (
        f"not through it in this forward: {', '.join(where)}. A layer whose forward calls an attention function "
        "itself (SDPA, a KV-compression or research patch of the attention forward) attends to this rank's shard of "
        "the sequence alone, so its output would be wrong. Attention must go through transformers' "
        "ALL_ATTENTION_FUNCTIONS[config._attn_implementation]: undo the patch of that layer's forward, or run the "
        "model on one process."
    )


def _other_attention(tb) -> str | None:
    """The attention module that ran one of transformers' own attention functions (sdpa_attention_forward, a
    model's eager_attention_forward, ...) in a failed forward of a patched model, where only the library's may
    run; None if none did."""
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name.endswith("attention_forward") and f"{os.sep}transformers{os.sep}" in code.co_filename:
            module = tb.tb_frame.f_locals.get("module")
            return f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}), which ran {code.co_name}"
        tb = tb.tb_next
    return None
