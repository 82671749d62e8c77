"""Run the unpatched single-process model and the context-parallel model on the same cases.

Every rank loads the same model. The reference for a case is the unpatched model run in-process
on one rank: nothing distributed touches it, so it *is* the single-process run. Cases go in
rounds of N: in each round rank r runs the reference of the round's r-th case (unpatched), then
all ranks patch the model and run the round's cases with context parallelism, and rank r compares
its case. The model is patched and unpatched in place (`remove_context_parallel` restores stock
behaviour bit for bit), so one copy of the weights serves both, references are computed N at a
time, and only one reference per rank is held at once. With `--reference FILE` the references
come from a saved single-process run instead (for models that fit only when sharded).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import hf_contextpar
from hf_contextpar.comm.group import resolve_group
from hf_contextpar.comm.replicas import Replicas, accelerate_layout, make_groups

from .needlebench import DataError
from .oracle import fingerprint

__all__ = ["Dist", "load_reference", "on_rank0", "run_rounds", "save_reference"]


class Dist:
    """Rank, world size and the few object collectives the harness needs (no-ops on one process)."""

    def __init__(self, timeout: float, cuda: bool, cp_size: int | None = None):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device(f"cuda:{local}" if cuda else "cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "MASTER_ADDR" not in os.environ:
            raise SystemExit("WORLD_SIZE > 1 but no MASTER_ADDR: start the harness with torchrun or accelerate launch.")
        # the library's one process-group start-up; the harness's own collectives use the default group
        timeout = None if dist.is_initialized() else timeout
        _, self.rank, self.world = resolve_group(device=self.device, timeout=timeout, replicas=False)
        self.group = dist.group.WORLD if self.world > 1 else None
        self.processes, self.cp_rank, self.replica, self.replicas = self.world, self.rank, 0, 1
        layout = self._layout(cp_size)
        if layout is not None and layout.count > 1:  # replicas x CP: each replica its share of the cases
            groups = make_groups(layout, timeout, across=False)
            self.group, self.world = groups.cp, layout.cp  # `world`: the N of the report, a replica's CP group
            self.replica, self.cp_rank, _ = layout.coordinates(self.rank)
            self.replicas = layout.count

    def _layout(self, cp_size: int | None):
        """The replicas x CP layout: --cp-size, else accelerate's parallelism config (its environment)."""
        if self.world == 1:
            return None
        try:
            layout = Replicas.of(self.world, cp_size) if cp_size else accelerate_layout(self.world)
        except hf_contextpar.ContextParallelError as e:
            raise SystemExit(f"error: {e}") from None
        if layout is not None and layout.tp > 1:
            raise SystemExit("error: the eval harness runs no tensor parallelism: leave tp_size at 1.")
        if layout is not None and layout.cp < 2:
            raise SystemExit("error: a replica of one process runs no context parallelism: give cp_size 2 or more.")
        return layout

    def broadcast(self, obj):
        """rank 0's `obj` on every rank (every process of the launch, every replica)."""
        if self.processes == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(self, obj) -> list:
        if self.processes == 1:
            return [obj]
        out = [None] * self.processes
        dist.all_gather_object(out, obj)
        return out

    def barrier(self):
        if self.processes > 1:
            dist.barrier()

    def close(self):
        if self.processes > 1 and dist.is_initialized():
            dist.barrier()  # nobody tears the group down while a peer still uses it
            dist.destroy_process_group()
        self.group = None  # a reference kept past the exit hook would destroy the group during finalization


def on_rank0(d: Dist, fn):
    """Run fn on rank 0 only and give every rank its result; an exception there becomes SystemExit everywhere
    (instead of the other ranks waiting for a broadcast that never comes)."""
    payload = None
    if d.rank == 0:
        try:
            payload = ("ok", fn())
        except DataError as e:
            payload = ("error", str(e))
        except Exception as e:  # noqa: BLE001 - reported to every rank, with its message
            payload = ("error", f"{type(e).__name__}: {e}")
    status, value = d.broadcast(payload)
    if status == "error":
        raise SystemExit(value)
    return value


def run_rounds(
    d: Dist, model, cases: list, *, strategy: str, reference: dict | None, ref_fn, cp_fn, compare_fn, desc: str
) -> list:
    """The loop described in the module docstring. Returns every case's record, in case order, on every rank."""
    from tqdm import tqdm

    mine = []
    patched = False
    share = cases[d.replica :: d.replicas]  # replicas: each runs every replicas-th case, all of them together
    bar = tqdm(total=len(share), desc=desc, disable=d.rank != 0, dynamic_ncols=True)
    for start in range(0, len(share), d.world):
        chunk = share[start : start + d.world]
        own = chunk[d.cp_rank] if d.cp_rank < len(chunk) else None
        if reference is None:
            if patched:
                hf_contextpar.remove_context_parallel(model)
                patched = False
            t0 = time.perf_counter()
            ref = ref_fn(model, own) if own is not None else None
            ref_s = time.perf_counter() - t0
        else:
            ref, ref_s = (reference[own["key"]] if own is not None else None), None
        if not patched:
            hf_contextpar.apply_context_parallel(model, strategy=strategy, group=d.group)
            patched = True
        for i, case in enumerate(chunk):
            bar.set_postfix_str(case["label"])
            t0 = time.perf_counter()
            out = cp_fn(model, case)
            cp_s = time.perf_counter() - t0
            if i == d.cp_rank:
                rec = compare_fn(case, ref, out)
                rec.update(
                    index=case["index"],
                    cp_seconds=round(cp_s, 3),
                    ref_seconds=round(ref_s, 3) if ref_s is not None else None,
                )
                mine.append(rec)
            bar.update(1)
    bar.close()
    if patched:
        hf_contextpar.remove_context_parallel(model)
    records = [r for part in d.all_gather(mine) for r in part]  # every rank's, from every replica: each case once
    return sorted(records, key=lambda r: r["index"])


def load_reference(path: str, kind: str, cases: list, meta: dict) -> dict:
    """A saved single-process run, checked against this run's cases (same prompts, same settings)."""
    if not os.path.exists(path):
        raise SystemExit(
            f"--reference {path}: no such file. Make it with the same command on one process and --save-reference FILE."
        )
    try:
        saved = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # a file that is not a saved reference (torch's message is about checkpoints)
        raise SystemExit(
            f"--reference {path} is not a reference saved with --save-reference ({type(e).__name__})."
        ) from None
    saved_kind = saved.get("kind") if isinstance(saved, dict) else type(saved).__name__
    if saved_kind != kind:
        raise SystemExit(f"--reference {path} is a {saved_kind} reference, not {kind}.")
    for k in ("model", "dtype", "weights") + (("max_new_tokens",) if kind == "needlebench" else ()):
        if k == "weights" and k not in saved["meta"]:  # saved before the weights were recorded
            continue
        if saved["meta"].get(k) != meta.get(k):
            raise SystemExit(
                f"--reference {path} was made with {k}={saved['meta'].get(k)!r}, this run has {meta.get(k)!r}."
            )
    refs = saved["cases"]
    for c in cases:
        r = refs.get(c["key"])
        if r is None:
            raise SystemExit(f"--reference {path} has no case {c['key']}; save a reference with the same arguments.")
        if r["prompt_sha"] != fingerprint(c["ids"]):
            raise SystemExit(
                f"--reference {path}: the prompt of case {c['key']} differs from this run's "
                "(different tokenizer, data or seed)."
            )
    return refs


def save_reference(path: str, kind: str, meta: dict, refs: dict):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.save(dict(kind=kind, meta=meta, cases=refs), path)
