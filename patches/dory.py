"""Dory: a recurrent section of layers run `n_recurrent_loops` times in one forward.

With `recurrent_kv_cache_mode="per_loop"` (its default) the loops after the first write their K/V to copies of the
recurrent section's cache layers, which DoryModel.forward appends to a cache of exactly `num_hidden_layers` layers
(loop i's copy of layer j at `num_hidden_layers + (i - 1) * n_recurrent_layers + j - n_input_layers`). The sharded
cache makes those copies up front (`cache_copies`), each sharded as its layer, so the model finds them and appends
none; each loop's attention then attends through the copy its update just wrote (`looped`), checked by the adapter
against what that update returned, each copy once per forward.

`"last_loop"` is refused: its earlier loops attend over the cache's stored K/V read directly (`layer.keys`, a rank's
shard under context parallelism) plus their own tokens, never stored, truncated to the window by position in that
concatenation, which no sharded cache layer answers."""

from __future__ import annotations

from hf_contextpar.errors import UnsupportedModelError
from hf_contextpar.model.families import FamilyHooks


def _loops(config) -> tuple[range, int]:
    """(the recurrent section's layers, how many times a forward runs it)."""
    start = config.n_input_layers
    return range(start, start + config.n_recurrent_layers), config.n_recurrent_loops


def check(config):
    mode = getattr(config, "recurrent_kv_cache_mode", "per_loop")  # DoryConfig's default
    if mode == "per_loop":
        return
    section, loops = _loops(config)
    if loops > 1 and len(section):
        raise UnsupportedModelError(
            f"Dory's recurrent_kv_cache_mode={mode!r}: its loops before the last attend "
            "over the cache's stored K/V read directly plus their own tokens, never stored, which a rank's share of "
            "a context-parallel cache cannot answer. Load the model with recurrent_kv_cache_mode='per_loop' (its "
            "default: one cache copy per loop, same outputs), or run it on one process."
        )


class Loops(FamilyHooks):
    def cache_copies(self, config) -> tuple:
        section, loops = _loops(config)
        return tuple(section) * (loops - 1) if config.recurrent_kv_cache_mode == "per_loop" else ()

    def looped(self, module) -> bool:
        section, loops = _loops(module.config)
        return loops > 1 and module.layer_idx in section


HOOKS = Loops()
