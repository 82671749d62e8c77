"""What a patched model cannot combine, refused at apply: the settings against the model's layout (TP, DCP, its
recurrent layers). Each refusal says what to use instead. The model's own layer kinds are the contract's
(contract.py), DSA's the indexer's (attention/indexed.py)."""

from __future__ import annotations

from ..errors import HeadsNotDivisibleError, UnsupportedModelError
from ..mesh import heads_per_rank
from .contract import check_ulysses


def check_layout(model, settings, world: int, shape, tp: int, dcp, chain: bool):
    """dcp: (group, index, size) of the TP ranks sharing this rank's KV head, or None; chain: recurrent layers."""
    if dcp is not None and settings.whole_heads:
        raise HeadsNotDivisibleError(
            f"strategy='ulysses' splits the KV heads over the context-parallel ranks, and each rank holds one KV "
            f"head here, shared with {dcp[2] - 1} other TP rank(s) by sequence (DCP): use another strategy."
        )
    if settings.whole_heads:  # the heads this rank's attention receives, not the config's (dbrx, TP)
        check_ulysses(model.config, world, (shape.heads, shape.kv_heads) if tp > 1 else heads_per_rank(model))
    if chain and (settings.decode == "ring_pass_q" or dcp is not None):
        what = "decode='ring_pass_q' (it moves sequences between ranks)" if dcp is None else "DCP (--tp over KV heads)"
        raise UnsupportedModelError(
            f"{what} is not supported on a model with recurrent layers: their states are whole on every rank "
            "and pass down the ranks in prefill. Use decode='auto' or 'replicated', and TP up to the KV heads."
        )
    if settings.sparse is not None and dcp is not None:
        raise UnsupportedModelError(
            "sparse=CSA(...) is not supported with DCP (TP beyond the KV heads): use TP up to the KV heads."
        )
