"""Latent KV (multi-head latent attention, MLA): what a layer caches is not what it attends with.

transformers' MLA models (DeepSeek-V2/V3, Kimi-K2, GLM-4-MoE-Lite, MiniCPM3, ...) cache one
compressed latent per token as "keys" and the shared RoPE part as "values", and their attention
module expands whatever the cache returns into per-head K and V with its own `expand_kv(latent,
rope)` before it calls attention. Under context parallelism the blocks that travel between
ranks are the latents as cached (for DeepSeek-V3 576 numbers a token against 40,960 for the
expanded heads); each rank expands the blocks it receives with the module's own `expand_kv`, so
the arithmetic is the model's. `install` wraps every module's `expand_kv` to record what it
expanded this forward; the attention adapter `take`s that record to know that the K/V it was
handed are the expansion of this layer's cache (the structural guard checks the cache's part).
"""

from __future__ import annotations

from dataclasses import dataclass

_RECORD = "_hf_contextpar_expanded"


@dataclass
class Expanded:
    """One `expand_kv` call: its inputs (as cached), its outputs (as attended) and the expansion itself."""

    cached_k: object
    cached_v: object
    k: object
    v: object
    expand: object


def latent_modules(model) -> list:
    """The attention modules that expand a cached latent into per-head K/V."""
    return [m for m in model.modules() if callable(getattr(m, "expand_kv", None)) and hasattr(m, "layer_idx")]


def _expanding(expand):
    """`expand`, also for a block of no tokens (a rank that holds none yet), which the models' reshapes refuse."""

    def expand_any(cached_k, cached_v):
        if cached_k.shape[2] > 0:
            return expand(cached_k, cached_v)
        k, v = expand(
            cached_k.new_zeros((*cached_k.shape[:2], 1, cached_k.shape[3])),
            cached_v.new_zeros((*cached_v.shape[:2], 1, cached_v.shape[3])),
        )
        return k[:, :, :0], v[:, :, :0]

    return expand_any


def install(model):
    """Wrap each latent module's `expand_kv` (an instance attribute over the class method); returns undo()."""
    modules = latent_modules(model)
    for module in modules:
        original = _expanding(module.expand_kv)

        def recording(cached_k, cached_v, _module=module, _expand=original):
            k, v = _expand(cached_k, cached_v)
            setattr(_module, _RECORD, Expanded(cached_k, cached_v, k, v, _expand))
            return k, v

        module.expand_kv = recording

    def undo():
        for module in modules:
            module.__dict__.pop("expand_kv", None)
            module.__dict__.pop(_RECORD, None)

    return undo


def take(module) -> Expanded | None:
    """The module's latest expansion, forgotten once taken (each attention call reads its own)."""
    return module.__dict__.pop(_RECORD, None)
