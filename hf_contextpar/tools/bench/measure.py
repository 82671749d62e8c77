"""What the benchmark measures per configuration: TTFT, TTIT, KV bytes, peak memory, traffic and
exposed communication, on every rank (the machine facts come from `hf_contextpar.tools.calibrate`)."""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from ...cache.sharded import cache_argument, returned_cache
from ...cache.states import state_nbytes
from ..calibrate import sync


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), or the machine's count where affinity is unknown."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _rss() -> tuple[int, int]:
    """(current, peak) resident set size in bytes; (0, 0) where /proc is missing."""
    try:
        fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError):
        return 0, 0


def _reset_peak(device):
    """Start a new peak-memory window: CUDA allocator stats, or Linux's VmHWM (clear_refs 5)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak(device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _rss()[1]


def kv_bytes(cache) -> int:
    """The attention cache's bytes on this rank: K/V and, for indexed attention (DSA), the indexer's keys,
    which transformers' cache layers keep beside them (`update_indexer`) and our sharded cache counts too."""
    if hasattr(cache, "local_nbytes"):
        return cache.local_nbytes()
    parts = (getattr(layer, name, None) for layer in cache.layers for name in ("keys", "values", "indexer_keys"))
    return sum(t.nbytes for t in parts if isinstance(t, torch.Tensor))


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


@torch.no_grad()
def prefill(model, ids, *, stats=None, barrier=None, device):
    """One timed prefill (forward over the prompt + argmax of the last logits): TTFT and its traffic."""
    if barrier:
        barrier()
    if stats is not None:
        stats.reset()
    c0, t0 = time.process_time(), time.perf_counter()
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    sync(device)
    res = dict(
        ttft_s=time.perf_counter() - t0,
        ttft_cpu_s=time.process_time() - c0,
        comm_wait_s=0.0,
        comm_wait_by_op_s={},
        bytes_sent=0,
        bytes_received=0,
        bytes_received_by_op={},
    )
    if stats is not None:
        res.update(
            comm_wait_s=stats.wait_s,
            comm_wait_by_op_s=dict(stats.waits),
            bytes_sent=stats.bytes_sent,
            bytes_received=stats.bytes_received,
            bytes_received_by_op=dict(stats.received_by_op),
        )
    return res, returned_cache(out), token


@torch.no_grad()
def decode(cache, token, model, *, new_tokens: int, stats=None, barrier=None, device):
    """`new_tokens - 1` timed greedy decode steps after a prefill; per-step times and the tokens."""
    tokens, steps, waits = [int(token[0, 0])], [], []
    cache_kw = {cache_argument(model): cache}
    if barrier:
        barrier()
    for _ in range(new_tokens - 1):
        if stats is not None:
            stats.reset()
        t0 = time.perf_counter()
        out = model(input_ids=token, **cache_kw, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        sync(device)
        steps.append(time.perf_counter() - t0)
        tokens.append(int(token[0, 0]))
        if stats is not None:
            waits.append(stats.wait_s)
    return dict(
        ttit_s=_median(steps),
        ttit_all_s=steps,
        decode_comm_wait_s=_median(waits) if waits else 0.0,
        tokens=tokens,
        kv_bytes=kv_bytes(cache),
        state_bytes=state_nbytes(cache),  # recurrent layers' conv and recurrent states (whole on every rank)
    )


class Samples:
    """Repeated prefill + decode of one configuration: TTFT median over prefills, TTIT over every step."""

    def __init__(self):
        self.prefills, self.steps, self.step_waits, self.final = [], [], [], {}

    def measure(self, model, ids, *, last: bool, new_tokens: int, stats=None, barrier=None, device):
        rss0 = _rss()[0]
        if last:
            _reset_peak(device)
        res, cache, token = prefill(model, ids, stats=stats, barrier=barrier, device=device)
        self.prefills.append(res)
        dec = decode(cache, token, model, new_tokens=new_tokens, stats=stats, barrier=barrier, device=device)
        self.steps += dec["ttit_all_s"]
        self.step_waits.append(dec["decode_comm_wait_s"])
        if last:  # peak, KV bytes and tokens of the last repeat (every repeat computes the same)
            self.final = dec
            peak = _peak(device)
            self.final.update(peak_bytes=peak, peak_delta_bytes=max(0, peak - rss0) if device.type == "cpu" else peak)

    def summary(self) -> dict:
        med = {k: _median([p[k] for p in self.prefills]) for k in ("ttft_s", "ttft_cpu_s", "comm_wait_s")}
        ops = {op for p in self.prefills for op in p["comm_wait_by_op_s"]}
        return dict(
            **{
                **self.final,
                "ttit_s": _median(self.steps),
                "ttit_all_s": self.steps,
                "decode_comm_wait_s": _median(self.step_waits),
            },
            **med,
            ttft_all_s=[p["ttft_s"] for p in self.prefills],
            comm_wait_by_op_s={op: _median([p["comm_wait_by_op_s"].get(op, 0.0) for p in self.prefills]) for op in ops},
            bytes_sent=self.prefills[-1]["bytes_sent"],
            bytes_received=self.prefills[-1]["bytes_received"],
            bytes_received_by_op=self.prefills[-1]["bytes_received_by_op"],
        )


class PeerSamples:
    """Repeated prefills of a peer (PyTorch's ring: no KV cache, no decode): TTFT, its CPU time and traffic."""

    def __init__(self):
        self.prefills, self.final = [], {}

    @torch.no_grad()
    def measure(self, peer, ids, *, last: bool, barrier=None, device):
        rss0 = _rss()[0]
        if last:
            _reset_peak(device)
        if barrier:
            barrier()
        peer.stats.reset()
        c0, t0 = time.process_time(), time.perf_counter()
        token = peer.first_token(ids)
        sync(device)
        self.prefills.append(
            dict(
                ttft_s=time.perf_counter() - t0,
                ttft_cpu_s=time.process_time() - c0,
                comm_wait_s=peer.stats.wait_s,
                comm_wait_by_op_s=dict(peer.stats.waits),
                bytes_sent=peer.stats.bytes_sent,
                bytes_received=peer.stats.bytes_received,
                bytes_received_by_op=dict(peer.stats.received_by_op),
            )
        )
        if last:
            peak = _peak(device)
            self.final = dict(
                tokens=[int(token[0, 0])],
                kv_bytes=0,
                state_bytes=0,
                peak_bytes=peak,
                peak_delta_bytes=max(0, peak - rss0) if device.type == "cpu" else peak,
            )

    def summary(self) -> dict:
        med = {k: _median([p[k] for p in self.prefills]) for k in ("ttft_s", "ttft_cpu_s", "comm_wait_s")}
        ops = {op for p in self.prefills for op in p["comm_wait_by_op_s"]}
        return dict(
            **self.final,
            **med,
            ttit_s=None,
            ttit_all_s=[],
            decode_comm_wait_s=None,
            ttft_all_s=[p["ttft_s"] for p in self.prefills],
            comm_wait_by_op_s={op: _median([p["comm_wait_by_op_s"].get(op, 0.0) for p in self.prefills]) for op in ops},
            bytes_sent=self.prefills[-1]["bytes_sent"],
            bytes_received=self.prefills[-1]["bytes_received"],
            bytes_received_by_op=self.prefills[-1]["bytes_received_by_op"],
        )


def small_collective_after_compute_s(numel: int, iters: int = 200, gather=None) -> float:
    """The same all-gather when each one follows ~1 ms of compute, as in decode: the peers' gloo
    threads have gone to sleep and must be woken, which back-to-back calls never pay (and ranks
    that finish their compute at different times wait for each other). gather(out, t): the
    transport to time (default: gloo's all-gather)."""
    t = torch.zeros(numel)
    out = torch.empty(numel * dist.get_world_size())
    gather = gather or getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    a, b = torch.randn(64, 256), torch.randn(256, 1024)

    def compute_only():
        t0 = time.perf_counter()
        a @ b
        a @ b
        return time.perf_counter() - t0

    def with_gather():
        t0 = time.perf_counter()
        a @ b
        a @ b
        gather(out, t)
        return time.perf_counter() - t0

    dist.barrier()
    base = statistics.median(compute_only() for _ in range(iters))
    dist.barrier()
    both = statistics.median(with_gather() for _ in range(iters))
    return max(0.0, both - base)
