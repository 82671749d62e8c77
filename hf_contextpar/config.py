"""Reading a transformers config where a value may be absent or differ per layer."""

from __future__ import annotations


def config_value(config, name: str):
    """A config attribute, or None where it is absent or differs per layer (transformers raises
    AmbiguousGlobalPerLayerAttributeError for a global read of a per-layer value, e.g. Gemma 4's
    head_dim): the cost model and the rank agreement then use what every layer shares."""
    try:
        return getattr(config, name, None)
    except RuntimeError:
        return None
