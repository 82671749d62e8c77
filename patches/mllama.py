"""Mllama (Llama 3.2 Vision's text model): cross-attention layers, run text-only as one process runs them.

`MllamaTextModel` skips a layer of `cross_attention_layers` when the forward has no `cross_attention_states` and the
layer's cache holds none (a text-only prompt and its decode): the layer does nothing, on one process and under
context parallelism alike, so the coverage check does not count those layers (`contract.attention_layers`). Given
vision states, such a layer attends from this rank's tokens to every vision state, a cross attention whose keys are
not the sequence's, which hf-contextpar's attention does not serve: this patch refuses those inputs before any
collective (the same arguments on every rank, so every rank refuses alike).
"""

from __future__ import annotations

from hf_contextpar.errors import UnsupportedInputError

_CROSS_INPUTS = ("cross_attention_states", "cross_attention_mask", "full_text_row_masked_out_mask")


def _text_only(module, args, kwargs):
    given = [name for name in _CROSS_INPUTS if kwargs.get(name) is not None]
    if given:
        raise UnsupportedInputError(
            f"{', '.join(given)} given: Mllama's cross-attention layers attend to vision states, which hf-contextpar "
            "does not shard; under context parallelism the model runs text-only (its cross-attention layers skipped, "
            "as one process skips them without vision states). Run image inputs on one process."
        )


def apply(model):
    """Refuse cross-attention inputs to the patched model; returns undo()."""
    handle = model.register_forward_pre_hook(_text_only, with_kwargs=True)
    return handle.remove
