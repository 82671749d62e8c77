"""Inkling 2 Loop (text): Inkling 2's layers (patches/inkling2.py), with a section of them run `loop_num_passes` times
in one forward, each pass after the first through copies of the section's cache layers.

Inkling2LoopTextModel.forward appends those copies to a cache of exactly `num_hidden_layers` layers (deep copies:
pass p's copy of loop layer j at `num_hidden_layers + (p - 1) * (loop_layer_index_end - loop_layer_index_start) + j -
loop_layer_index_start`, reached as `layer_idx + cache_offset` by the attention's update and its short convolutions).
The sharded cache makes those copies up front (`cache_copies`), each sharded (K/V) and chained (convolution states) as
its layer, so the model finds them and appends none; each pass's attention attends through the copy its update just
wrote (`looped`). The passes after the first gate their inputs with messages from the previous pass, read over each
token's own layers' states by `Inkling2LoopMessageAttentionResidual`: like the residuals over depth, it runs the
family's eager attention on every rank for its own tokens, as one process does."""

from __future__ import annotations

from hf_contextpar.model.families import FamilyHooks

from . import inkling2, ported


def _section(config) -> tuple[range, int]:
    """(the looped layers, how many passes a forward runs over them)."""
    return range(config.loop_layer_index_start, config.loop_layer_index_end), config.loop_num_passes


def _messages(self, block_states, partial_block_states, loop_layer_idx):
    """transformers' Inkling2LoopMessageAttentionResidual.forward (5.x) through the family's eager attention: each
    token attends over its own states of the previous pass, which never leave its rank."""
    import torch

    if not ported.switched(self.config):
        return type(self).forward(self, block_states, partial_block_states, loop_layer_idx)
    stacked = self.norm(torch.cat([block_states, partial_block_states.unsqueeze(-2)], dim=-2).float())
    hidden_size = stacked.shape[-1]
    query = self.query[loop_layer_idx].float().expand(*stacked.shape[:-2], -1, -1)
    out, _ = inkling2.eager_of(self)(self, query, stacked, stacked, None, scaling=hidden_size**-0.5)
    return out.transpose(1, 2)


class Loops(FamilyHooks):
    def cache_copies(self, config) -> tuple:
        section, passes = _section(config)
        return tuple(section) * (passes - 1)

    def looped(self, module) -> bool:
        section, passes = _section(module.config)
        return passes > 1 and module.layer_idx in section


HOOKS = Loops()


def apply(model):
    """Patch every Inkling 2 Loop attention, attention residual and message residual of `model` (reversible)."""
    return inkling2.apply(model, "Inkling2Loop", extra=(("Inkling2LoopMessageAttentionResidual", _messages),))
