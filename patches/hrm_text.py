"""HRM (text): one attention module per stack layer, run in every cycle, each cycle in a cache slot of its own.

`HrmTextModel` runs its L stack `L_cycles` times and its H stack once per high cycle (`H_cycles` times), and
each call of a layer's attention updates cache slot `layer_idx + cycle_offset` (`config.num_hidden_layers`
counts the slots). The module's own `layer_idx` is the stack layer's, so hf-contextpar's adapter, which
takes each call's K/V from the sharded cache layer of the module's `layer_idx`, saw one module attend
several times with other K/V than its layer's (refused). This patch runs each call with the module's
`layer_idx` set to the slot (and `cycle_offset` 0, so the model updates the same slot): the cache layer,
the attention and the adapter's checks all see the slot one process updates, one attention per slot.

`config.prefix_lm` (the default) makes the prompt's `token_type_ids == 1` tokens one bidirectional block of
the first forward's mask (`block_sequence_ids`), which hf-contextpar's causal attention does not build: such
a forward is refused (`UnsupportedInputError`, before any collective, from the replicated inputs).
"""

from __future__ import annotations

import inspect

from hf_contextpar.errors import UnsupportedInputError


def _slotted(module, forward):
    base = module.layer_idx

    def run(*args, cycle_offset: int = 0, **kwargs):
        module.layer_idx = base + cycle_offset
        try:
            return forward(*args, cycle_offset=0, **kwargs)
        finally:
            module.layer_idx = base

    return run


def _refuse_prefix_block(model, args, kwargs):
    types = kwargs.get("token_type_ids")
    if types is None and args:  # passed by position
        names = list(inspect.signature(type(model).forward).parameters)[1:]
        types = dict(zip(names, args)).get("token_type_ids")
    if types is not None and getattr(model.config, "prefix_lm", False) and bool((types == 1).any()):
        raise UnsupportedInputError(
            "token_type_ids marks a bidirectional prefix block (HRM's prefix_lm): hf-contextpar's attention is causal "
            "(and sliding-window causal) only. Pass no token_type_ids (or none equal to 1), or run on one process."
        )


def apply(model):
    """Slot every HrmTextAttention call by its cycle; refuse a prefix block. Returns undo()."""
    modules = [m for m in model.modules() if type(m).__name__ == "HrmTextAttention"]
    for module in modules:
        module.forward = _slotted(module, module.forward)
    handle = model.register_forward_pre_hook(_refuse_prefix_block, with_kwargs=True)

    def undo():
        handle.remove()
        for module in modules:
            module.__dict__.pop("forward", None)

    return undo
