"""What users' own code does to a model's attention, written once for the tests that draw it
(user_code_worker.py, fuzz_worker.py)."""

from __future__ import annotations


def attention_modules(model) -> list:
    """The model's attention modules: those named *Attention that know their layer."""
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]


def call_sdpa_itself(model):
    """Patch the last attention module's forward to call SDPA itself (what KV-compression patches do): its own
    code, with ALL_ATTENTION_FUNCTIONS' SDPA in place of the configured attention. Returns the patched module,
    or None where the model has no attention module with a config."""
    layers = attention_modules(model)
    if not layers or not hasattr(layers[-1], "config"):
        return None
    layer, forward = layers[-1], layers[-1].forward

    def sdpa_itself(*args, **kwargs):
        config, saved = layer.config, layer.config._attn_implementation
        config._attn_implementation = "sdpa"
        try:
            return forward(*args, **kwargs)
        finally:
            config._attn_implementation = saved

    layer.forward = sdpa_itself
    return layer
