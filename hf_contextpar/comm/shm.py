"""A shared-memory all-gather for CPU ranks on one host: decode's one collective per layer.

Decode exchanges a few KB per layer per token ((out, LSE) of one query row per head). Over gloo
that costs a TCP round trip through gloo's worker threads, 0.3-1 ms on a CPU host: at 16K tokens
on 2 processes as much as the attention it parallelises. Ranks on one host can instead meet in a
file mapped by all of them (/dev/shm): each writes its part and raises a stamp, then reads the
others' parts once their stamps show up, a few microseconds when the ranks arrive together.

Protocol, per gather k (counted alike on every rank, since every rank runs the same collectives):
rank r copies its bytes into slot k % 2 at offset r * n, then writes stamp[r][k % 2] = k and
n_bytes[r][k % 2] = n; a reader waits until every rank's stamp for that slot reads k, checks the
sizes agree, and copies the slot out. Two slots suffice because each gather is complete (copied
out) before its caller posts the next one: a rank writing gather k + 2 into slot k % 2 has seen
every rank's stamp k + 1, and each rank raised that only after copying gather k out.
Correctness relies on stores becoming visible in program order (the payload before its stamp), which
x86-64 guarantees (TSO); other architectures keep using gloo.

A waiting rank spins briefly, then yields its core, then sleeps in 0.1 ms steps; it fails with a
clear error after the group's timeout, or as soon as a peer's process is gone.
"""

from __future__ import annotations

import os
import platform
import socket
import time
import uuid

import torch
import torch.distributed as dist

from ..errors import PeerFailureError, RankMismatchError

SLOT_BYTES = 1 << 20  # per rank and slot; larger gathers use gloo
_LINE = 8  # int64s per cache line: each (rank, slot) header entry on its own line
_SPINS = 64  # polls before yielding the core
_SPIN_S = 0.005  # seconds of yielding before sleeping between polls
_PROBE_S = 1.0  # seconds between checks that the peers' processes are alive


_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


def _host() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _timeout_s(group, default: float) -> float:
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except Exception:  # not every backend or torch version exposes it
        return default


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. EPERM: exists
        return True
    return True


class ShmGather:
    """All-gather of equally sized CPU tensors through one mapped file (see the module docstring)."""

    def __init__(self, buf: torch.Tensor, rank: int, world: int, pids: list[int], timeout: float):
        self.rank, self.world, self.pids, self.timeout = rank, world, pids, timeout
        header = 2 * world * _LINE
        self._head = buf[: header * 8].view(torch.int64).numpy()  # polled: numpy reads are cheapest
        self._slots = buf[header * 8 :].view(2, world * SLOT_BYTES).unbind(0)  # the two slots' views, taken once
        self._buf = buf
        self._k = 0

    def fits(self, t: torch.Tensor, extra: torch.Tensor | None = None) -> bool:
        """Whether `t` (and `extra` appended to it) can go through here: CPU and at most SLOT_BYTES."""
        n = t.numel() * t.element_size() + (0 if extra is None else extra.numel() * extra.element_size())
        return t.device.type == "cpu" and n <= SLOT_BYTES

    def all_gather(self, flat: torch.Tensor) -> torch.Tensor:
        """(world * flat.numel(),) of every rank's flat contiguous `flat`, in rank order."""
        self._k += 1
        k, s, n = self._k, self._k % 2, flat.numel() * flat.element_size()
        slot = self._slots[s]
        if n:
            slot[self.rank * n : (self.rank + 1) * n].copy_(flat.view(torch.uint8))
        at = (self.rank * 2 + s) * _LINE
        self._head[at + 1] = n
        self._head[at] = k  # the stamp last: readers trust the bytes once it shows
        self._wait(k, s)
        for r in range(self.world):
            if self._head[(r * 2 + s) * _LINE + 1] != n:
                sizes = [int(self._head[(q * 2 + s) * _LINE + 1]) for q in range(self.world)]
                raise RankMismatchError(
                    f"context-parallel rank {self.rank}/{self.world}: the ranks' all-gather #{k} sizes differ "
                    f"({sizes} bytes, by rank): they are running different collectives. Every rank must get the "
                    "same inputs and calls."
                )
        return slot[: self.world * n].clone().view(flat.dtype)  # a copy: the slot is written again two gathers on

    def gather_into(self, out: torch.Tensor, t: torch.Tensor, group=None) -> None:
        """`dist.all_gather_into_tensor`'s signature, for timing this transport beside gloo's."""
        out.copy_(self.all_gather(t.contiguous().view(-1)))

    def _wait(self, k: int, s: int) -> None:
        head, stamps = self._head, [(r * 2 + s) * _LINE for r in range(self.world) if r != self.rank]
        polls, start, probe = 0, None, None
        while True:
            stamps = [at for at in stamps if head[at] != k]
            if not stamps:
                return
            polls += 1
            if polls < _SPINS:
                continue
            now = time.monotonic()
            if start is None:
                start = probe = now
            if now - start < _SPIN_S:
                _yield()
                continue
            time.sleep(1e-4)
            if now - probe >= _PROBE_S:
                probe = now
                missing = [at // (2 * _LINE) for at in stamps]
                dead = [r for r in missing if not _alive(self.pids[r])]
                if dead or now - start > self.timeout:
                    why = (
                        f"rank(s) {dead} exited" if dead else f"no word from rank(s) {missing} in {self.timeout:.0f} s"
                    )
                    raise PeerFailureError(
                        f"context-parallel rank {self.rank}/{self.world}: shared-memory all-gather #{k} failed: "
                        f"{why}. Check the other ranks' logs (waits end after apply_context_parallel(timeout=...))."
                    )

    def close(self) -> None:
        self._head = self._slots = self._buf = None


def _create(path: str, size: int) -> str | None:
    """Create the file with its pages reserved: a sparse file on a full /dev/shm (64 MB in a default
    Docker container) would end in SIGBUS at the first write; this fails here instead (-> gloo)."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return None
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)
        else:
            os.ftruncate(fd, size)
        return path
    except OSError:
        os.unlink(path)
        return None
    finally:
        os.close(fd)


def open_shm_gather(group, rank: int, world: int, device: torch.device, default_timeout: float) -> ShmGather | None:
    """A ShmGather when every rank is a CPU process on this host (x86-64), else None; every rank
    gets the same answer. HF_CONTEXTPAR_SHM=0 on any rank keeps gloo for all."""
    size = 2 * world * _LINE * 8 + 2 * world * SLOT_BYTES
    path = None
    wanted = (
        device.type == "cpu"
        and dist.get_backend(group) == "gloo"
        and platform.machine().lower() in ("x86_64", "amd64")
        and os.environ.get("HF_CONTEXTPAR_SHM", "1") != "0"
        and os.path.isdir("/dev/shm")
    )
    if wanted and rank == 0:
        path = _create(os.path.join("/dev/shm", f"hf_contextpar-{uuid.uuid4().hex}"), size)
    facts = [None] * world
    dist.all_gather_object(facts, (wanted, _host(), os.getpid(), path), group=group)
    path = facts[0][3]
    usable = path is not None and all(f[0] and f[1] == facts[0][1] for f in facts)
    gather, ok = None, False
    if usable:
        try:
            buf = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            gather, ok = ShmGather(buf, rank, world, [f[2] for f in facts], _timeout_s(group, default_timeout)), True
        except (OSError, RuntimeError):
            pass
    oks = [None] * world
    dist.all_gather_object(oks, ok, group=group)  # everyone has mapped it (or failed) before it goes
    if rank == 0 and path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass
    if not all(oks):
        if gather is not None:
            gather.close()
        return None
    return gather
