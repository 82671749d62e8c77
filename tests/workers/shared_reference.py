"""The unpatched reference model run once, on rank 0, with its outputs handed to every rank.

A matrix worker compares each rank's patched model with the single-process run. Every rank computing
that same run itself is N copies of identical work, and on CI's 2 cores N = 4 ranks make it four times
the CPU time of the reference. `OnRankZero(model)` is called like the model: rank 0 runs it, and the
others receive its output, bit for bit, through the default group's object broadcast. The reference
stays the unpatched model on one process, and nothing distributed touches its computation. A reference
that raises raises on every rank. The cache a forward returns stays on rank 0, the only rank that
passes it back.
"""

from __future__ import annotations

import torch.distributed as dist
from transformers.utils import ModelOutput


class OnRankZero:
    def __init__(self, model):
        self.model = model

    def __getattr__(self, name):  # configs, embeddings, generation_config: the model's own
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        return _shared(lambda: self.model(*args, **kwargs))

    def generate(self, *args, **kwargs):
        return _shared(lambda: self.model.generate(*args, **kwargs))


def _shared(run):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return run()
    box = [None]
    if dist.get_rank() == 0:
        try:
            out, box = run(), None
            box = [("ok", _without_cache(out))]
        except Exception as e:  # noqa: BLE001 - raised again on every rank
            box = [("error", e)]
            out = None
        dist.broadcast_object_list(box, src=0)
        if box[0][0] == "error":
            raise box[0][1]
        return out
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise value
    return value


def _without_cache(out):
    """What the other ranks receive: the output without its cache (only rank 0 runs the reference on)."""
    if isinstance(out, ModelOutput) and getattr(out, "past_key_values", None) is not None:
        out = type(out)(**{k: v for k, v in out.items() if k != "past_key_values"})
    return out
