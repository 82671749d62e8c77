"""The cost model's `Shape` of a loaded model: read from its config and, under tensor parallelism,
from the shards this rank holds (a collective over the TP group). The cost model itself
(`plan/costmodel.py`) stays a pure function of shapes, machines and token counts."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ..cache.sharded import cache_windows
from ..config import config_value
from ..mesh import heads_per_rank, local_numel, tensor_parallel
from ..plan.costmodel import Shape


def model_shape(model) -> Shape:
    """The shape of a loaded model as one rank holds it: its decoder's linear weights per layer
    (whatever the decoder calls its layers) and, under tensor parallelism, this rank's shard of
    them and the query and KV heads its attention receives (mesh.heads_per_rank; every rank of
    the TP group must call this together)."""
    text = model.config.get_text_config(decoder=True)
    heads = config_value(text, "num_attention_heads") or 1  # none: recurrent layers alone (Mamba2)
    head_dim = config_value(text, "head_dim") or text.hidden_size // heads
    linear = [local_numel(m.weight) for m in model.get_decoder().modules() if isinstance(m, torch.nn.Linear)]
    weights = sum(linear) // max(1, text.num_hidden_layers)
    elem = next(model.parameters()).element_size()
    kv = config_value(text, "num_key_value_heads") or heads
    tp = tensor_parallel(model)[1]
    if tp > 1:  # the heads this rank's attention gets (collective over the TP group)
        heads, kv = heads_per_rank(model) or (heads // tp, kv // tp)
    latent = config_value(text, "kv_lora_rank")  # MLA caches one latent and a RoPE part per token
    kv_elems = latent + (config_value(text, "qk_rope_head_dim") or 0) if latent else 0
    head_dim = (config_value(text, "qk_head_dim") or head_dim) if latent else head_dim
    windows = config_windows(model.config)
    return Shape(
        text.num_hidden_layers, heads, kv, head_dim, weights, elem, windows, kv_elems, partial_bytes=max(4, elem)
    )


def config_windows(config) -> tuple:
    """Per layer, the sliding window the model's own cache keeps (transformers decides which
    layers slide: `DynamicCache(config=...)`), or None; () where that cache cannot be built."""
    try:
        windows = tuple(cache_windows(DynamicCache(config=config)))
    except Exception:  # a config transformers' cache does not understand: model every layer as full
        return ()
    return windows if any(w is not None for w in windows) else ()
