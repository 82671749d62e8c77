"""Resolve the context-parallel process group.

Order: an explicit `torch.distributed` group; else the default group if someone (accelerate,
the user) already initialised one; else the environment `torchrun` / `accelerate launch` set
(RANK, WORLD_SIZE, MASTER_ADDR), initialising gloo for CPU models and nccl for CUDA ones;
else a single process, where context parallelism is a no-op.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0


def _backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def resolve_group(group=None, *, device: torch.device, timeout: float | None = None):
    """Return (group, rank, world_size); group is None when running on one process."""
    if group is not None:
        return group, dist.get_rank(group), dist.get_world_size(group)
    td = datetime.timedelta(seconds=timeout if timeout is not None else DEFAULT_TIMEOUT_S)
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "MASTER_ADDR" not in os.environ:
            return None, 0, 1
        if device.type == "cuda" and "LOCAL_RANK" in os.environ:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend=_backend_for(device), timeout=td)
        group = dist.group.WORLD
    elif timeout is not None:
        # A group of our own, so the caller's timeout bounds every wait of ours.
        group = dist.new_group(backend=dist.get_backend(), timeout=td)
    else:
        group = dist.group.WORLD
    world = dist.get_world_size(group)
    if world == 1:
        return None, 0, 1
    return group, dist.get_rank(group), world
