"""Output gathering: every rank ends a forward with the whole output, in the original order.

A rank computes the logits of its own rows (its tokens, or its sequences in batched decode) and
the hidden states of its tokens; the plan's `Outputs` says where each rank's rows go. One padded
all-gather per tensor puts them back together, identical on every rank.
"""

from __future__ import annotations

from .errors import UnsupportedModelError
from .plan.forward import Gather, Outputs


def gather_outputs(output, outputs: Outputs, comm, model_name: str, streams: bool = False):
    """The forward's output with its logits and hidden states gathered from every rank (in place). streams: the
    model's hidden states may carry parallel streams after the token dim (hyper-connections' (B, T, hc, H)), so
    every tensor's batch and token dims are counted from the front (0 and 1) rather than from the back."""
    if outputs.logits is None:  # every rank computed every row
        return output
    if isinstance(output, tuple):
        raise UnsupportedModelError(
            f"{model_name} returned a tuple although asked for return_dict=True; hf-contextpar gathers every "
            "rank's logits from the model's output object, so a model that always returns tuples is not supported."
        )
    if getattr(output, "logits", None) is not None:
        output.logits = gather_rows(output.logits, outputs.logits, comm, streams)
    if getattr(output, "hidden_states", None) is not None:
        output.hidden_states = tuple(gather_rows(h, outputs.hidden, comm, streams) for h in output.hidden_states)
    return output


def gather_rows(local, gather: Gather, comm, streams: bool = False):
    """Rows held by each rank -> all of them in order, identical on every rank. The rows are the token
    dim (-2: logits (B, T, V), hidden states (B, T, H), Gemma 3n's AltUp-stacked (4, B, T, H); with streams,
    dim 1: hyper-connections' (B, T, hc, H)) or, for batch rows (gather.dim 0), the sequence dim before it."""
    if streams:
        axis = gather.dim
    else:
        axis = local.dim() - 2 if gather.dim == 1 else local.dim() - 3
    rows = local.movedim(axis, 0)
    counts = [s.numel() for s in gather.slots]
    padded = rows.new_zeros((max(counts), *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    everyone = comm.all_gather(padded, tag="control")
    out = rows.new_empty((gather.total, *rows.shape[1:]))
    for r, slots in enumerate(gather.slots):
        out[slots.to(out.device)] = everyone[r, : counts[r]]
    return out.movedim(0, axis).contiguous()
