"""N context-parallel ranks in one process: the attention algorithms run unmodified on threads.

`SimulatedWorld(N)` hands out one `SimulatedComm` per rank, a stand-in for `comm.Comm` with its
methods (send_recv, send_next, recv_prev, all_gather, all_gather_start, broadcast_blocks,
all_to_all), the same semantics and the same byte accounting (`stats`, `tagged`). Each simulated
rank runs on its own thread; messages move through shared mailboxes instead of a process group,
so one process (one GPU, or a CPU-only CI job) can check every algorithm against whole-sequence
attention: one GPU can host only one NCCL rank.

What is checked on the way, where a real process group would hang or silently garble data:
point-to-point messages are matched in posting order per (sender, receiver) pair, as NCCL and
gloo match them; a send completes only once the peer has posted the matching receive (so a
rendezvous deadlock deadlocks here too); a receive of another shape or dtype than the one sent
is an error; the k-th collective must be the same operation, with agreeing shapes, on every
rank; a send buffer must be contiguous and must not change before the sender's `wait()`; a
message nobody received is an error when the run ends. Every wait has a timeout (a deadlock is
reported, naming the rank and the wait), and a rank that fails stops the others, so a broken
algorithm fails fast with the failing rank's error. tests/*/test_algorithms.py checks that the
real `Comm` over gloo gives bit-identical results and the same byte and call counts.

`run_algorithm` runs one plan's algorithm on every rank (each with its own `step.Step`);
`shard_inputs` cuts whole-sequence Q, K, V the way the runtime and the sharded cache would.
"""

from __future__ import annotations

import threading
import time

import torch

from ...cache import blocks
from ...comm.collectives import CommStats, broadcast_bytes, nbytes
from ...errors import ContextParallelError


class SimulationError(ContextParallelError):
    """A simulated rank failed, or the ranks' messages did not match."""


class _Aborted(Exception):
    """Raised in a waiting rank once another rank has failed (reported as that rank's error)."""


class SimulatedWorld:
    """Shared state of N simulated ranks: mailboxes, collective slots, one lock for all of it."""

    def __init__(self, world: int, timeout: float = 60.0):
        self.world, self.timeout = world, timeout
        self.cond = threading.Condition()
        self.failed: str | None = None
        self.mail: dict = {}  # (src, dst, index) -> a copy of the sent tensor; index counts src's sends to dst
        self.sent = [[0] * world for _ in range(world)]  # [src][dst]: messages posted
        self.posted_recvs = [[0] * world for _ in range(world)]  # [dst][src]: receives posted
        self.slots: dict = {}  # collective index -> {rank: (op, payload)}
        self.comms = [SimulatedComm(self, r) for r in range(world)]

    def wait_for(self, ready, what: str, rank: int):
        """Block (holding self.cond) until ready() is true; fail on timeout or when another rank failed."""
        deadline = time.monotonic() + self.timeout
        while not ready():
            if self.failed is not None:
                raise _Aborted(self.failed)
            left = deadline - time.monotonic()
            if left <= 0:
                raise SimulationError(
                    f"simulated rank {rank}/{self.world}: {what} still waiting after {self.timeout:g}s "
                    "(a deadlock: the peer never posted the matching send or collective)"
                )
            self.cond.wait(left)

    def run(self, fns: list) -> list:
        """Run fns[r](comms[r]) on one thread per rank; returns their results in rank order.

        The first rank error (in time) is re-raised, as a SimulationError naming the rank, chained to
        the original; afterwards, a message that was sent but never received is an error too.
        """
        results, errors, order = [None] * self.world, [None] * self.world, []

        def body(r):
            try:
                results[r] = fns[r](self.comms[r])
            except _Aborted:
                pass
            except BaseException as e:  # noqa: BLE001 - reported below, with the rank
                errors[r] = e
                with self.cond:
                    order.append(r)
                    if self.failed is None:
                        self.failed = f"rank {r} failed: {type(e).__name__}: {e}"
                    self.cond.notify_all()

        threads = [
            threading.Thread(target=body, args=(r,), name=f"sim-rank-{r}", daemon=True) for r in range(self.world)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout * 4)
            if t.is_alive():
                raise SimulationError(f"simulated {t.name} did not finish within {4 * self.timeout:.0f}s")
        if order:
            r, e = order[0], errors[order[0]]
            if isinstance(e, SimulationError):
                raise e
            raise SimulationError(f"simulated rank {r}/{self.world} failed: {type(e).__name__}: {e}") from e
        left = sorted((src, dst) for src, dst, _ in self.mail)
        if left:
            raise SimulationError(f"messages sent but never received (src, dst): {left}")
        return results


class SimulatedComm:
    """One simulated rank's `Comm`: the same methods, semantics, tags and byte accounting."""

    def __init__(self, sim: SimulatedWorld, rank: int):
        self.sim, self.rank, self.world = sim, rank, sim.world
        self.stats = CommStats()  # every operation; control ones are named "control <op>"
        self.tagged = {"attention": CommStats(), "control": CommStats()}
        self._collectives = 0  # index of this rank's next collective

    def _record(self, tag: str, op: str, sent: int, received: int):
        self.stats.record(op if tag == "attention" else f"{tag} {op}", sent, received)
        self.tagged[tag].record(op, sent, received)

    def _add_wait(self, tag: str, op: str, seconds: float):
        self.stats.add_wait(op if tag == "attention" else f"{tag} {op}", seconds)
        self.tagged[tag].add_wait(op, seconds)

    # -- the ring: one hop to the next rank, from the previous one ------------------------------
    def send_recv(self, send: torch.Tensor, recv_shape) -> _Pending:
        """One ring hop, posted without waiting: `send` to rank+1, a block of `recv_shape` from rank-1."""
        return self._post_p2p("ring_shift", send, torch.empty(recv_shape, dtype=send.dtype, device=send.device))

    def send_next(self, send: torch.Tensor, op: str = "ring_send") -> _Pending:
        """Post `send` to rank+1; wait() before touching `send` again."""
        return self._post_p2p(op, send, None)

    def recv_prev(self, shape, dtype, device, op: str = "ring_recv") -> _Pending:
        """Post the receive of a block of `shape` from rank-1; wait() returns it."""
        return self._post_p2p(op, None, torch.empty(shape, dtype=dtype, device=device))

    def _post_p2p(self, op: str, send, recv) -> _Pending:
        """Empty blocks are not posted (on either side, as in `Comm`)."""
        sim, nxt, prv = self.sim, (self.rank + 1) % self.world, (self.rank - 1) % self.world
        posted_send = send_index = recv_index = None
        if send is not None and send.numel() > 0:
            if not send.is_contiguous():
                raise SimulationError(
                    f"simulated rank {self.rank}: {op} of a non-contiguous tensor (torch.distributed refuses it)"
                )
            posted_send = (send, send.clone())
            with sim.cond:
                send_index = sim.sent[self.rank][nxt]
                sim.mail[(self.rank, nxt, send_index)] = posted_send[1]
                sim.sent[self.rank][nxt] += 1
                sim.cond.notify_all()
        if recv is not None and recv.numel() > 0:
            with sim.cond:
                recv_index = sim.posted_recvs[self.rank][prv]
                sim.posted_recvs[self.rank][prv] += 1
                sim.cond.notify_all()
        self._record("attention", op, nbytes(send) if send is not None else 0, nbytes(recv) if recv is not None else 0)

        def finish():
            if posted_send is not None:
                if not torch.equal(*posted_send):
                    raise SimulationError(f"simulated rank {self.rank}: an {op} send buffer changed before wait()")
                with sim.cond:  # a send completes once the peer has posted its receive (NCCL/gloo rendezvous)
                    sim.wait_for(
                        lambda: sim.posted_recvs[nxt][self.rank] > send_index,
                        f"{op} send #{send_index} to rank {nxt} (no matching receive posted)",
                        self.rank,
                    )
            if recv_index is None:
                return recv
            key = (prv, self.rank, recv_index)
            with sim.cond:
                sim.wait_for(lambda: key in sim.mail, f"{op} receive #{recv_index} from rank {prv}", self.rank)
                got = sim.mail.pop(key)
            if got.shape != recv.shape or got.dtype != recv.dtype:
                raise SimulationError(
                    f"simulated rank {self.rank}: {op} receive #{recv_index} expected {tuple(recv.shape)} "
                    f"{recv.dtype} from rank {prv}, which sent {tuple(got.shape)} {got.dtype}"
                )
            recv.copy_(got)
            return recv

        return _Pending(self, op, finish)

    # -- collectives ---------------------------------------------------------------------
    def _post(self, op: str, payload) -> int:
        """Deposit this rank's part of its next collective; returns the collective's index."""
        sim, index = self.sim, self._collectives
        self._collectives += 1
        with sim.cond:
            slot = sim.slots.setdefault(index, {})
            for r, (other, _) in slot.items():
                if other != op:
                    raise SimulationError(f"collective #{index}: rank {self.rank} called {op}, rank {r} called {other}")
            slot[self.rank] = (op, payload)
            sim.cond.notify_all()
        return index

    def _collect(self, index: int, op: str, ranks=None) -> dict:
        """Wait until `ranks` (default all) have posted collective `index`; returns {rank: payload}."""
        sim = self.sim
        ranks = range(self.world) if ranks is None else ranks
        with sim.cond:
            slot = sim.slots[index]
            sim.wait_for(lambda: all(r in slot for r in ranks), f"{op} (collective #{index})", self.rank)
            for r in ranks:
                if slot[r][0] != op:
                    raise SimulationError(
                        f"collective #{index}: rank {self.rank} called {op}, rank {r} called {slot[r][0]}"
                    )
            return {r: slot[r][1] for r in ranks}

    def all_gather(self, t: torch.Tensor, tag: str = "attention") -> torch.Tensor:
        """Stack of every rank's equally shaped `t`, in rank order: (world, *t.shape)."""
        return self.all_gather_start(t, tag).wait()

    def all_gather_start(self, t: torch.Tensor, tag: str = "attention") -> _Pending:
        """`all_gather` posted without waiting; `wait()` returns the (world, *t.shape) stack."""
        index = self._post("all_gather", t.contiguous().clone())
        self._record(tag, "all_gather", nbytes(t) * (self.world - 1), nbytes(t) * (self.world - 1))

        def finish():
            parts = self._collect(index, "all_gather")
            for r, p in parts.items():
                if p.shape != t.shape or p.dtype != t.dtype:
                    raise SimulationError(
                        f"all_gather: rank {self.rank} has {tuple(t.shape)} {t.dtype}, "
                        f"rank {r} has {tuple(p.shape)} {p.dtype}"
                    )
            return torch.stack([parts[r] for r in range(self.world)])

        return _Pending(self, "all_gather", finish, tag)

    def broadcast_blocks(self, mine: torch.Tensor, shapes: list, op: str = "broadcast") -> list:
        """Every rank's block to every rank at its exact size; `wait()` on entry r returns rank r's block."""
        mine = mine.contiguous()
        index = self._post("broadcast", mine)
        self._record("attention", op, *broadcast_bytes(mine, shapes, self.rank))

        def block(r):
            if r == self.rank:
                if mine.shape != torch.Size(shapes[r]):
                    raise SimulationError(
                        f"broadcast: rank {r}'s block is {tuple(mine.shape)}, "
                        f"its own shapes[{r}] says {tuple(shapes[r])}"
                    )
                return mine
            got = self._collect(index, "broadcast", [r])[r]
            if got.shape != torch.Size(shapes[r]) or got.dtype != mine.dtype:
                raise SimulationError(
                    f"broadcast: rank {self.rank} expected {tuple(shapes[r])} {mine.dtype} "
                    f"from rank {r}, which sent {tuple(got.shape)} {got.dtype}"
                )
            return got.clone()

        return [_Pending(self, "broadcast", lambda r=r: block(r)) for r in range(self.world)]

    def all_to_all(self, send: list, recv_shapes: list) -> list:
        """send[j] goes to rank j; returns what every rank sent to this one (shapes known in advance)."""
        send = [t.contiguous().clone() for t in send]
        index = self._post("all_to_all", send)
        out_sizes = [int(torch.Size(s).numel()) for s in recv_shapes]
        esize = send[0].element_size()
        total_in = sum(t.numel() for t in send)
        self._record(
            "attention",
            "all_to_all",
            esize * (total_in - send[self.rank].numel()),
            esize * (sum(out_sizes) - out_sizes[self.rank]),
        )
        t0 = time.perf_counter()
        parts = self._collect(index, "all_to_all")
        self._add_wait("attention", "all_to_all", time.perf_counter() - t0)
        out = []
        for r, shape in enumerate(recv_shapes):
            got = parts[r][self.rank]
            if got.numel() != out_sizes[r] or got.dtype != send[0].dtype:
                raise SimulationError(
                    f"all_to_all: rank {self.rank} expected {tuple(shape)} {send[0].dtype} "
                    f"from rank {r}, which sent {tuple(got.shape)} {got.dtype}"
                )
            out.append(got.reshape(shape).clone())
        return out


class _Pending:
    """What `comm.Pending` is: `wait()` returns the received tensor (or None)."""

    def __init__(self, comm: SimulatedComm, op: str, finish, tag: str = "attention"):
        self._comm, self._op, self._finish, self._tag = comm, op, finish, tag

    def done(self) -> bool:  # a simulated message is delivered when waited for: nothing in flight to keep
        return True

    def wait(self):
        t0 = time.perf_counter()
        try:
            return self._finish()
        finally:
            self._comm._add_wait(self._tag, self._op, time.perf_counter() - t0)


# -- inputs as the runtime and the sharded cache lay them out ---------------------------------
def local_rows(plan, rank: int, x: torch.Tensor) -> torch.Tensor:
    """Rank's query rows of x (B, H, S, ...), indexed by global column: its sequences, its columns."""
    if plan.shards.seq_rows is not None:
        x = x[plan.shards.seq_rows[rank]]
    return x.index_select(2, plan.shards.q_cols[rank].to(x.device))


def pack_kv(cols: torch.Tensor, k: torch.Tensor, v: torch.Tensor, empty: float = 0.0) -> torch.Tensor:
    """The K/V block (`blocks.pack_kv`'s layout) a rank holds for key columns `cols` (1D, or (B, slots)
    with -1 for empty slots, filled with `empty`), from whole-sequence k, v (B, Hkv, S, D)."""
    if cols.dim() == 1:
        kv = blocks.pack_kv(k, v).index_select(3, cols.to(k.device))  # (2 or 1, B, Hkv, slots, D)
    else:
        idx = cols.clamp(min=0).to(k.device)
        kv = blocks.pack_kv(*(torch.stack([x[b].index_select(1, idx[b]) for b in range(x.shape[0])]) for x in (k, v)))
        hole = (cols < 0).to(k.device)[None, :, None, :, None]
        kv = kv.masked_fill(hole, empty)
    return kv.contiguous()


def shard_inputs(plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, empty: float = 0.0):
    """Per rank: its queries and its K/V block, from whole-sequence q (B, H, S, D) and k, v (B, Hkv, S, D).

    Queries are rows of global columns (only the plan's new columns are used); every rank's K/V
    is what its sharded cache holds during the forward (`plan.shards.kv_cols`), or this forward's own
    K/V for the "local" algorithm, whose kv_cols are the new columns too.
    """
    qs = [local_rows(plan, r, q).contiguous() for r in range(plan.world)]
    kvs = [pack_kv(plan.shards.kv_cols[r], k, v, empty) for r in range(plan.world)]
    return qs, kvs


def run_algorithm(
    plan,
    qs: list,
    kvs: list,
    *,
    scale: float,
    window=None,
    softcap=None,
    algorithm=None,
    num_layers: int = 1,
    timeout: float = 60.0,
    layer_kv=None,
):
    """Run the plan's attention algorithm on every simulated rank, for `num_layers` layers.

    qs[r], kvs[r]: rank r's queries (B_r, H, T_r, D) and K/V block (2, B, Hkv, slots, D), used by
    every layer (layers exercise what an algorithm carries from one layer to the next, e.g.
    KV-Runahead's early receives). `algorithm`: a registry name or a callable with the same
    signature (default: plan.algorithm). layer_kv(rank): that rank's `step.LayerKV` (latent or
    mixed head sizes), whose padding and output width are applied as the attention adapter does. Returns (outputs, comms): outputs[r][layer] = (out, lse)
    as the algorithm returned them, comms[r] = rank r's SimulatedComm (its `stats` and `tagged`
    byte counts).
    """
    from ...attention import algorithm as algorithm_of
    from ...attention.step import LayerKV, Step

    fn = algorithm if callable(algorithm) else algorithm_of(algorithm or plan.algorithm)
    sim = SimulatedWorld(plan.world, timeout)

    def rank_body(comm):
        geometry = (kvs[comm.rank].shape[0], kvs[comm.rank].shape[2], kvs[comm.rank].shape[4])
        step = Step(plan, comm, None, num_layers, kv_shapes=dict.fromkeys(range(num_layers), geometry))  # warmed
        kv = layer_kv(comm.rank) if layer_kv is not None else LayerKV()
        q = kv.pad(qs[comm.rank])
        outs = []
        for layer in range(num_layers):
            call = step.at(layer, kv=kv)
            out, lse = fn(call, q, kvs[comm.rank], scale=scale, window=window, softcap=softcap)
            outs.append((out[..., : call.out_shape(q)[-1]] if out is not None else None, lse))
        return outs

    outputs = sim.run([rank_body] * plan.world)
    return outputs, sim.comms
