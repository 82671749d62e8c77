"""The collectives the attention algorithms use, with byte accounting and clear failures.

One `Comm` per patched model. Every operation counts the bytes this rank sends and receives
under a tag, "attention" (what the strategies move, which tests check against the papers'
formulas) or "control" (the input checks and the output gathers), so `stats` holds everything
and `tagged[tag]` one kind; and it counts the wall time this rank spends blocked
in communication (`stats.wait_s`, per operation in `stats.waits`): the whole of a blocking
collective, and for the ring only the posting plus the part of `wait()` that the attention of
the block in hand did not hide, i.e. the exposed communication. On CUDA these are host-side
times (NCCL waits are stream-ordered). A failing collective (a peer died, the timeout
expired) is re-raised as a ContextParallelError naming the rank and the operation.
All-gathers of CPU tensors go through shared memory when every rank is a process on this host
(`shm.py`); everything else through the process group.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..errors import ContextParallelError, PeerFailureError


@dataclass
class CommStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    calls: dict = field(default_factory=dict)
    wait_s: float = 0.0  # seconds blocked in communication (exposed), all operations
    waits: dict = field(default_factory=dict)  # the same per operation
    received_by_op: dict = field(default_factory=dict)  # bytes received per operation

    def record(self, op: str, sent: int, received: int):
        self.bytes_sent += sent
        self.bytes_received += received
        self.calls[op] = self.calls.get(op, 0) + 1
        self.received_by_op[op] = self.received_by_op.get(op, 0) + received

    def add_wait(self, op: str, seconds: float):
        self.wait_s += seconds
        self.waits[op] = self.waits.get(op, 0.0) + seconds

    def reset(self):
        self.bytes_sent = self.bytes_received = 0
        self.wait_s = 0.0
        self.calls.clear()
        self.waits.clear()
        self.received_by_op.clear()


_live: weakref.WeakSet[Comm] = weakref.WeakSet()  # every Comm, for release_groups()


def release_groups() -> None:
    """Every Comm drops its process group and shared memory (at exit: see comm/group.release_at_exit)."""
    for comm in list(_live):
        comm.group = None
        comm.close_shm()


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def broadcast_bytes(mine: torch.Tensor, shapes: list, rank: int) -> tuple[int, int]:
    """(sent, received) of broadcasting every rank's block at its exact size (`Comm.broadcast_blocks`): this rank's
    block to each of the others, and every other rank's block from it."""
    received = mine.element_size() * sum(int(torch.Size(s).numel()) for r, s in enumerate(shapes) if r != rank)
    return nbytes(mine) * (len(shapes) - 1), received


class Comm:
    def __init__(self, group, rank: int, world: int):
        self.group, self.rank, self.world = group, rank, world
        self.stats = CommStats()  # every operation; control ones are named "control <op>"
        self.tagged = {"attention": CommStats(), "control": CommStats()}
        self._global = [dist.get_global_rank(group, r) for r in range(world)]
        self._next, self._prev = self._global[(rank + 1) % world], self._global[(rank - 1) % world]
        self._gate = None  # a check to run before the next message (see `check_before_next`)
        self._rider = None  # (fingerprint, verify) riding on the next shared-memory all-gather
        self.shm = None  # a ShmGather when every rank is a CPU process on this host (set by apply)
        _live.add(self)

    def close_shm(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None

    def check_before_next(self, fingerprint: torch.Tensor, verify) -> None:
        """Gather every rank's `fingerprint` and run `verify(stack)` before the next message is posted
        (or at `run_check()`).

        The runtime checks each forward's inputs this way: ranks whose inputs differ would run
        mismatched collectives, so the check must pass before the first message, but need not cost a
        collective of its own. Over shared memory the fingerprint rides on that message when it is an
        all-gather (decode: the first layer's), so decode runs one collective per layer and nothing
        else; a mismatch then shows as unequal sizes (an error) or in the fingerprints, verified before
        the gathered data is used. Otherwise (a ring hop first, or gloo) it is gathered on its own: over
        gloo posted now and waited for right before the first message, so the compute up to that
        message hides its latency."""
        if self.shm is not None and self.shm.fits(fingerprint):
            self._rider = (fingerprint.contiguous().view(-1), verify)
            self._gate = self._gather_rider
        else:
            pending = self.all_gather_start(fingerprint, tag="control")
            self._gate = lambda: verify(pending.wait())

    def drop_check(self) -> None:
        """Forget a pending check (a forward that raised: its collective may be in flight)."""
        self._gate = self._rider = None

    def run_check(self) -> None:
        """Run the pending check now (`check_before_next`): before a message, or at a forward's end where none ran."""
        if self._gate is not None:
            check, self._gate = self._gate, None
            check()

    def _gather_rider(self) -> None:
        fingerprint, verify = self._rider
        self._rider = None
        verify(self.all_gather(fingerprint, tag="control"))

    def _record(self, tag: str, op: str, sent: int, received: int):
        self.stats.record(op if tag == "attention" else f"{tag} {op}", sent, received)
        self.tagged[tag].record(op, sent, received)

    def _guard(self, what: str, op: str | None = None, tag: str = "attention") -> _Guard:
        """Translate failures into ContextParallelError and charge the time spent to stats.waits[op]."""
        return _Guard(self, what, op or what, tag)

    # -- the ring: one hop to the next rank, from the previous one --------------------------------
    def send_recv(self, send: torch.Tensor, recv_shape) -> Pending:
        """One ring hop, posted without waiting: `send` to rank+1, a block of `recv_shape` from rank-1
        (same dtype and device). Empty blocks are not posted."""
        recv = torch.empty(recv_shape, dtype=send.dtype, device=send.device)
        return self._post("ring_shift", send, recv)

    def send_next(self, send: torch.Tensor, op: str = "ring_send") -> Pending:
        """Post `send` to rank+1 (KV-Runahead's chain, the recurrent states'); wait() before touching `send` again.
        op: the name its bytes and waits are counted under."""
        return self._post(op, send, None)

    def recv_prev(self, shape, dtype, device, op: str = "ring_recv") -> Pending:
        """Post the receive of a block of `shape` from rank-1; wait() returns it."""
        return self._post(op, None, torch.empty(shape, dtype=dtype, device=device))

    def _post(self, op: str, send: torch.Tensor | None, recv: torch.Tensor | None) -> Pending:
        self.run_check()
        ops = []
        if send is not None and send.numel() > 0:
            ops.append(dist.P2POp(dist.isend, send, self._next, self.group))
        if recv is not None and recv.numel() > 0:
            ops.append(dist.P2POp(dist.irecv, recv, self._prev, self.group))
        with self._guard("ring send/recv", op):
            works = dist.batch_isend_irecv(ops) if ops else []
        self._record("attention", op, nbytes(send) if send is not None else 0, nbytes(recv) if recv is not None else 0)
        return Pending(self, works, recv, op)

    def all_gather(self, t: torch.Tensor, tag: str = "attention") -> torch.Tensor:
        """Stack of every rank's equally shaped `t`, in rank order: (world, *t.shape)."""
        flat = t.contiguous().view(-1)
        if self._rider is not None and self.shm.fits(flat, extra=self._rider[0]):
            return self._all_gather_riding(t, flat, tag)
        self.run_check()
        with self._guard("all_gather", "all_gather", tag):
            if self.shm is not None and self.shm.fits(flat):
                out = self.shm.all_gather(flat)
            else:
                out = torch.empty(self.world * flat.numel(), dtype=t.dtype, device=t.device)
                _all_gather_flat(out, flat, group=self.group)
        self._record(tag, "all_gather", nbytes(t) * (self.world - 1), nbytes(t) * (self.world - 1))
        return out.view(self.world, *t.shape)

    def _all_gather_riding(self, t: torch.Tensor, flat: torch.Tensor, tag: str) -> torch.Tensor:
        """`all_gather(t)` with the pending input fingerprint appended to every rank's bytes."""
        (fingerprint, verify), n = self._rider, nbytes(flat)
        self._rider = self._gate = None
        with self._guard("all_gather", "all_gather", tag):
            both = torch.cat([flat.view(torch.uint8), fingerprint.view(torch.uint8)])
            out = self.shm.all_gather(both).view(self.world, -1)
        verify(out[:, n:].contiguous().view(fingerprint.dtype))
        self._record(tag, "all_gather", n * (self.world - 1), n * (self.world - 1))
        self._record("control", "all_gather", *(2 * [nbytes(fingerprint) * (self.world - 1)]))
        return out[:, :n].contiguous().view(t.dtype).view(self.world, *t.shape)

    def all_gather_start(self, t: torch.Tensor, tag: str = "attention") -> Pending:
        """`all_gather` posted without waiting; `wait()` returns the (world, *t.shape) stack.

        For a check that need not block the forward (every rank's input fingerprint): posted before
        the forward, waited for after it, its latency hides under the forward's compute instead of
        adding one collective per decode step. Collectives on one group run in posting order on
        every rank, so later collectives of the forward queue behind it safely. Always over the
        process group.
        """
        self.run_check()
        flat = t.contiguous().view(-1)
        out = torch.empty(self.world * flat.numel(), dtype=t.dtype, device=t.device)
        with self._guard("all_gather", "all_gather", tag):
            work = _all_gather_flat(out, flat, group=self.group, async_op=True)
        self._record(tag, "all_gather", nbytes(t) * (self.world - 1), nbytes(t) * (self.world - 1))
        return Pending(self, [work], out.view(self.world, *t.shape), "all_gather", tag)

    def broadcast_blocks(self, mine: torch.Tensor, shapes: list[tuple], op: str = "broadcast") -> list[Pending]:
        """Every rank's block to every rank at its exact size: an all-gather of unequal blocks.

        Rank r's block goes out by one broadcast rooted at r, straight from its buffer (no padding,
        no staging copy); all N are posted at once and `wait()` on entry r returns rank r's block,
        so a caller can work on the blocks that have landed while the rest are in flight.
        shapes[r]: rank r's block shape, known to every rank. op: the name its bytes and waits are counted under.
        """
        self.run_check()
        mine = mine.contiguous()
        out = []
        for r, shape in enumerate(shapes):
            buf = mine if r == self.rank else torch.empty(shape, dtype=mine.dtype, device=mine.device)
            works = []
            if buf.numel() > 0:
                with self._guard("broadcast", op):
                    works = [dist.broadcast(buf, self._global[r], group=self.group, async_op=True)]
            out.append(Pending(self, works, buf, op))
        self._record("attention", op, *broadcast_bytes(mine, shapes, self.rank))
        return out

    def all_to_all(self, send: list[torch.Tensor], recv_shapes: list[tuple]) -> list[torch.Tensor]:
        """send[j] goes to rank j; returns what every rank sent to this one (shapes known in advance)."""
        self.run_check()
        flat = torch.cat([t.reshape(-1) for t in send])
        out_sizes = [int(torch.Size(s).numel()) for s in recv_shapes]
        out = torch.empty(sum(out_sizes), dtype=flat.dtype, device=flat.device)
        in_sizes = [t.numel() for t in send]
        with self._guard("all_to_all", "all_to_all"):
            dist.all_to_all_single(out, flat, out_sizes, in_sizes, group=self.group)
        esize = flat.element_size()
        self._record(
            "attention",
            "all_to_all",
            esize * (flat.numel() - in_sizes[self.rank]),
            esize * (out.numel() - out_sizes[self.rank]),
        )
        return [chunk.view(shape) for chunk, shape in zip(out.split(out_sizes), recv_shapes)]


class _Guard:
    """`Comm._guard`'s context: a class rather than a generator (contextlib's costs microseconds per use, and
    decode runs one collective per layer per token)."""

    __slots__ = ("comm", "what", "op", "tag", "t0")

    def __init__(self, comm: Comm, what: str, op: str, tag: str):
        self.comm, self.what, self.op, self.tag = comm, what, op, tag

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, kind, e, tb):
        comm, seconds = self.comm, time.perf_counter() - self.t0
        comm.stats.add_wait(self.op if self.tag == "attention" else f"{self.tag} {self.op}", seconds)
        comm.tagged[self.tag].add_wait(self.op, seconds)
        if isinstance(e, (RuntimeError, dist.DistError)) and not isinstance(e, ContextParallelError):
            raise PeerFailureError(
                f"context-parallel rank {comm.rank}/{comm.world}: {self.what} failed ({type(e).__name__}: {e}). "
                "If that names a connection, a closed peer or a timeout, another rank exited or stalled: check "
                "the other ranks' logs (waits end after apply_context_parallel(timeout=...)); otherwise the "
                "error is this rank's own."
            ) from e
        return False


# torch >= 2.10 names it all_gather_single and deprecates the old name
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Pending:
    """Posted communication; wait() blocks until it is done and returns what was received (or None)."""

    def __init__(self, comm: Comm, works, recv, op: str, tag: str = "attention"):
        self._comm, self._works, self._recv, self._op, self._tag = comm, works, recv, op, tag

    def done(self) -> bool:
        """Has every posted operation completed (without waiting)?"""
        return all(w.is_completed() for w in self._works)

    def wait(self) -> torch.Tensor | None:
        what = "ring send/recv" if self._op.startswith("ring") else self._op
        with self._comm._guard(what, self._op, self._tag):
            for w in self._works:
                w.wait()
        return self._recv
