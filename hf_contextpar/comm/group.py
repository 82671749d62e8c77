"""Resolve the context-parallel process group.

Order: an explicit `torch.distributed` group; else the default group if someone (accelerate,
the user) already initialised one; else the environment `torchrun` / `accelerate launch` set
(RANK, WORLD_SIZE, MASTER_ADDR), initialising gloo for CPU models and nccl for CUDA ones;
else a single process, where context parallelism is a no-op. Where an accelerate parallelism config
(its object, or the PARALLELISM_CONFIG_* environment) splits the world into replicas x CP (x TP),
the group is this rank's replica's CP group (replicas.py).

Teardown at exit (`release_at_exit`, an `atexit` hook registered with the first group resolved
here): every Comm drops its reference to its group, and a process group hf-contextpar created
(the default group it initialised, or the group of its own it makes for a `timeout`) is
destroyed. Otherwise the group's destructor, which joins gloo's
worker and TCP threads, ran only when the model <-> runtime reference cycle was collected, i.e.
during interpreter finalization; a gloo thread that then needs the GIL (to drop the last
reference to a tensor whose Python object it kept alive) is stopped by CPython with
pthread_exit, whose unwinding through a noexcept C++ destructor ends in std::terminate:
"terminate called without an active exception", SIGABRT, now and then, after a clean run.
The same holds for any reference to the group that outlives the hook: `torch.distributed.nn.functional`
binds `group=group.WORLD` as default arguments when first imported (transformers imports it lazily,
on the first config or model made), so it is imported with this module, before any group exists
(when a script imports hf_contextpar before it initialises its group, as the examples do), and
where a script made its group first, `unbind_world_defaults` sets those defaults back to None (the
default group, as they read before any group existed) at apply and at exit, so the group dies when
its owner destroys it. A group the caller made and never destroys stays registered in
torch.distributed until finalization: that one `dist.destroy_process_group()` is the caller's.
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys

import torch
import torch.distributed as dist

if dist.is_available():  # bind its `group=group.WORLD` defaults while no group exists (module docstring)
    try:
        import torch.distributed.nn.functional  # noqa: F401
    except ImportError:  # a torch build without it: nothing binds the group
        pass

DEFAULT_TIMEOUT_S = 300.0
_WORLD = object()  # stands for the default group in _created
_created: list = []  # process groups hf-contextpar created, oldest first
_hooked = False


def _backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def resolve_group(group=None, *, device: torch.device, timeout: float | None = None, replicas: bool = True):
    """Return (group, rank, world_size); group is None when running on one process. `replicas=False`: the
    whole world, whatever accelerate's parallelism config says (a tool that splits it into replicas itself)."""
    if group is not None:
        _hook_exit()
        return group, dist.get_rank(group), dist.get_world_size(group)
    td = datetime.timedelta(seconds=timeout if timeout is not None else DEFAULT_TIMEOUT_S)
    made_world = False
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "MASTER_ADDR" not in os.environ:
            return None, 0, 1
        if device.type == "cuda" and "LOCAL_RANK" in os.environ:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend=_backend_for(device), timeout=td)
        _created.append(_WORLD)
        made_world = True
    if replicas and (mine := _replicas(timeout)) is not None:  # accelerate's parallelism config: the replica's
        group = mine.cp
    elif made_world:
        group = dist.group.WORLD
    elif _same_on_every_rank(timeout) is not None:
        # A group of our own, so the caller's timeout bounds every wait of ours.
        group = dist.new_group(backend=dist.get_backend(), timeout=td)
        _created.append(group)
    else:
        group = dist.group.WORLD
    _hook_exit()
    world = dist.get_world_size(group) if group is not None else 1
    if world == 1:
        return None, 0, 1
    return group, dist.get_rank(group), world


def _replicas(timeout):
    """This rank's groups where an accelerate parallelism config splits the world into several CP groups (or TP
    groups), else None: the layout agreed by every rank first (it decides which groups are made)."""
    from .replicas import accelerate_layout, make_groups

    layout = _agreed(
        lambda: accelerate_layout(dist.get_world_size()),
        "the accelerate parallelism config differs between ranks",
        "launch every rank with the same PARALLELISM_CONFIG_* environment",
    )
    if layout is None or (layout.count == 1 and layout.tp == 1):
        return None
    groups = make_groups(layout, timeout if timeout is not None else DEFAULT_TIMEOUT_S, across=False)
    if groups.cp is not None:
        _created.append(groups.cp)  # this model's: released when it is unpatched (release_group)
    return groups


def _same_on_every_rank(timeout):
    """The timeout, after checking every rank passed the same: it decides whether a group is made."""
    return _agreed(
        lambda: timeout,
        "apply_context_parallel got a different timeout on different ranks",
        "pass the same on every rank",
    )


def _agreed(compute, differs: str, fix: str):
    """compute() on every rank, the same everywhere: a value that decides which groups are made (`new_group`, a
    collective every rank must enter), so ranks that differed would wait on each other. A refusal raised on some
    ranks only is raised on every rank, as itself."""
    from ..errors import ContextParallelError, RankMismatchError

    try:
        mine = (None, compute())
    except ContextParallelError as e:
        mine = (e, None)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for error, _ in everyone:
        if error is not None:
            raise error
    values = [value for _, value in everyone]
    if any(v != values[0] for v in values):
        raise RankMismatchError(f"{differs} ({values}, by rank); {fix}.")
    return values[0]


def unbind_world_defaults() -> None:
    """Set every `group=<the default group>` default argument of torch.distributed.nn.functional back to
    None, which means the default group there too: bound when the module was first imported after a
    group existed, they would keep that group alive after `destroy_process_group`, into finalization."""
    functional = sys.modules.get("torch.distributed.nn.functional")
    for fn in vars(functional).values() if functional is not None else ():
        defaults = getattr(fn, "__defaults__", None) if callable(fn) else None
        if defaults and any(isinstance(d, dist.ProcessGroup) for d in defaults):
            fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)


def _hook_exit() -> None:
    unbind_world_defaults()  # every apply passes here, after transformers imported the module
    global _hooked
    if not _hooked:
        atexit.register(release_at_exit)
        _hooked = True


def release_at_exit() -> None:
    """Tear down what hf-contextpar set up, while the interpreter is still whole (an `atexit` hook).

    Every Comm drops its group (so no patched model keeps a process group alive into
    finalization), then the groups hf-contextpar created are destroyed, newest first; their
    destructors join gloo's threads here. Groups the caller created are left to the caller.
    Idempotent; a group the caller already destroyed is skipped.
    """
    from .collectives import release_groups

    unbind_world_defaults()
    release_groups()
    while _created:
        group = _created.pop()
        if group is _WORLD:
            if dist.is_initialized():
                dist.destroy_process_group()
        elif dist.is_initialized() and group in dist.distributed_c10d._world.pg_map:
            dist.destroy_process_group(group)


def release_group(group) -> None:
    """Destroy a group of its own that hf-contextpar made for one model (`timeout=`), when that model
    is unpatched or its patching failed: every apply/remove cycle would otherwise keep N-1 more
    connections open. Every rank calls it; the barrier first makes sure no peer is still connecting
    or talking on the group (a peer tearing its end down early breaks theirs). The default group,
    shared by every model, stays until exit."""
    if group is None or group not in _created:
        return
    _created.remove(group)
    if dist.is_initialized() and group in dist.distributed_c10d._world.pg_map:
        try:
            dist.barrier(group=group)
        except (RuntimeError, dist.DistError):
            return  # a peer is gone: leave the group to the exit hook rather than fail here
        dist.destroy_process_group(group)


def release_dropped(comm) -> None:
    """A patched model was garbage-collected without remove_context_parallel (a weakref finaliser, api.py): close
    its shared memory and destroy the group of its own it had (`timeout=`). No barrier: the ranks collect their
    model at different moments, and a dropped model has no forward in flight on its group."""
    comm.close_shm()
    group, comm.group = comm.group, None
    if group is None or group not in _created:
        return
    _created.remove(group)
    if dist.is_initialized() and group in dist.distributed_c10d._world.pg_map:
        dist.destroy_process_group(group)
