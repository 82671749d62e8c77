"""Gemma 3n and Gemma 4: KV shared across layers.

Their last `num_kv_shared_layers` layers ("reuse" in the config's `kv_sharing_modes`) attend with the very K/V an
earlier layer's cache update returned: the last layer of their own layer type before the shared ones (its mode
"store"), handed over in the modeling code's `shared_kv_states[layer_type]`; they update no cache layer of their own.
So a reuse layer's cache layer is that store layer, read from the config once per model: the adapter's explicit
mapping (`FamilyHooks.kv_source`), checked there against what that layer's update returned in the forward."""

from __future__ import annotations

import weakref

from hf_contextpar.model.families import FamilyHooks

# attention module -> the layer whose K/V it reuses (None: its own), read once (a decode step asks every layer)
_sources: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def sources(config) -> dict:
    """{reuse layer: the store layer of its layer type} from the config (transformers' rule, its modeling code's)."""
    modes, types = config.kv_sharing_modes, config.layer_types
    store = {types[j]: j for j, mode in enumerate(modes) if mode == "store"}
    return {i: store[types[i]] for i, mode in enumerate(modes) if mode == "reuse"}


class SharedKV(FamilyHooks):
    def kv_source(self, module) -> int | None:
        if module not in _sources:
            _sources[module] = sources(module.config).get(module.layer_idx)
        return _sources[module]


HOOKS = SharedKV()
