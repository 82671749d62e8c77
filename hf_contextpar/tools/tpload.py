"""The tools' models over a (cp, tp) mesh (hf_contextpar.mesh): a built-in, hub or local model with
its weights read already sharded by transformers' TP plan.

A built-in `tiny-<family>` model has no checkpoint: it is built once per node (by the node's local
rank 0, seeded: the same weights `models.load` builds), saved to a temporary directory that every
rank then reads its shard from, and removed after the load.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from ..mesh import init_world, load_tp_cp
from ..model.families import REGISTRY
from ..models import TINY_CONFIGS, builtin_model_path, byte_tokenizer, tiny_model


def load_tp(name: str, tp: int, dtype: torch.dtype | str, device: torch.device, **tiny_overrides):
    """(model, tokenizer, cp_group, tp_group) for a tools' model name (see models.load) on tp x cp ranks;
    tiny_overrides: config fields of a tiny-<family> model (e.g. num_key_value_heads)."""
    from transformers import AutoTokenizer

    if name.startswith("tiny-") and name[5:] in TINY_CONFIGS:
        family = name[5:]
        impl = REGISTRY[family].reference_attn if family in REGISTRY else "sdpa"
        dtype = torch.float32 if dtype == "auto" else dtype  # random weights: no checkpoint dtype to keep
        init_world(device.type)
        where = [tempfile.mkdtemp(prefix="hf_contextpar_tp_") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(where, src=0)
        local_first = int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0
        try:
            if local_first:  # one save per node (rank 0's node: into the folder rank 0 made)
                os.makedirs(where[0], exist_ok=True)
                tiny_model(family, dtype=dtype, attn_implementation=impl, **tiny_overrides).save_pretrained(where[0])
            dist.barrier()
            model, cp_group, tp_group = load_tp_cp(where[0], tp, dtype, device, attn_implementation=impl)
            dist.barrier()  # every rank has read its shard
        finally:
            if local_first:
                shutil.rmtree(where[0], ignore_errors=True)
        return model, byte_tokenizer(), cp_group, tp_group
    if tiny_overrides:
        raise ValueError(f"config overrides apply to the built-in tiny-<family> models only, not {name!r}.")
    path = builtin_model_path(name) or name
    tok = AutoTokenizer.from_pretrained(path)
    model, cp_group, tp_group = load_tp_cp(path, tp, dtype, device)
    return model, tok, cp_group, tp_group


def weight_bytes(model) -> int:
    """Bytes of weights this rank holds (its shards of the TP-sharded ones, all of the replicated)."""
    from ..mesh import local_numel

    return sum(local_numel(p) * p.element_size() for p in model.parameters())
