"""Every attention algorithm as a specification (issue 12), in ring-flash-attention's shape.

The specification lives in `hf_contextpar.tools.selftest.spec` (one copy, shared with `python -m
hf_contextpar selftest --simulated`): whole-sequence Q, K, V are cut the way a plan says, the
plan's algorithm runs unmodified on N simulated ranks (`hf_contextpar.tools.selftest.simulated`, one thread per
rank), and every rank's (out, LSE) must equal plain whole-sequence attention and its traffic the
analytical bytes. This file runs it as a CPU matrix.

A test id reads `<case>-N<ranks>-T<length>-<heads>-<mask>-<dtype>`. T is the number of new
tokens of a prefill, or the prompt length before the decode steps of a decode case. Seeded random
sequences of forwards cover the combinations the matrix does not list. Issue 13's single-GPU
check runs the same specification on CUDA in bf16/fp16/fp32 (`selftest --simulated`, run by
tests/multi_process/test_cuda.py where a GPU is present). The last tests break an algorithm or its messages on
purpose and check that this file notices.

This file holds the checks that run in the pytest process; the ones that launch ranks are in tests/multi_process/test_algorithms.py.
"""

from __future__ import annotations

import importlib
import itertools
import random
import threading

import pytest
import torch

from hf_contextpar.attention import step as step_module
from hf_contextpar.cache.sharded import ShardLayout
from hf_contextpar.plan.forward import build_plan
from hf_contextpar.plan.policy import Policy, fixed
from hf_contextpar.plan.sharding import partition_sizes
from hf_contextpar.tools.selftest.simulated import SimulatedWorld, SimulationError
from hf_contextpar.tools.selftest.spec import (
    CASES,
    DTYPES,
    HEADS,
    SOFTCAP,
    Case,
    check_case,
    check_plans,
    lengths,
    make_padding,
    random_qkv,
)

# the package re-exports the function under the module's name, so fetch the module itself
ring_pass_kv_module = importlib.import_module("hf_contextpar.attention.ring_pass_kv")

MASKS = [
    "causal",
    "pad",
    "window",
    "softcap",
    "all",
    "chunk",
]  # "pad": left padding and holes; "all": pad+window+softcap
# "chunk": chunked attention (Llama 4) over left-padded rows, each counting its chunks from its first real token
LOW_MASKS = {"fp32": ("causal", "all"), "bf16": ("all",)}  # on CPU with GQA only (fp16: the selftest): fast
MHA_MASKS = ("causal", "pad")  # head grouping is independent of window and soft-cap


def _params():
    """The CPU matrix: fp64 over every case, N, length and mask (MHA for fewer masks), fp32 and bf16 for a
    few masks with GQA (the kernels' own paths). CUDA in bf16/fp16/fp32: tests/multi_process/test_cuda.py (the selftest)."""
    out = []
    runs = [(name, *dt) for name, dt in DTYPES["cpu"].items() if name == "fp64" or name in LOW_MASKS]
    for case, n, heads, mask, (dname, dtype, tol) in itertools.product(CASES, (2, 3, 4), HEADS, MASKS, runs):
        if heads in ("mha", "mla") and mask not in MHA_MASKS:
            continue
        if heads == "mla" and case.algorithm == "ulysses":  # refused: one latent cannot be split by head
            continue
        if dname != "fp64" and (mask not in LOW_MASKS[dname] or heads != "gqa"):
            continue
        for length in lengths(case, n):
            out.append(
                pytest.param(
                    case, n, length, heads, mask, dtype, tol, id=f"{case.name}-N{n}-T{length}-{heads}-{mask}-{dname}"
                )
            )
    return out


@pytest.mark.parametrize("case,n,length,heads,mask,dtype,tol", _params())
def test_algorithm(case, n, length, heads, mask, dtype, tol):
    check_case(case, n, length, heads, mask, dtype, tol)


def test_a_new_strategy_is_one_file_and_one_record(monkeypatch):
    """A strategy is an algorithm file (tests/toy_strategy.py) and one record: registered, it runs through
    the plan, exact on simulated ranks with its own traffic formula checked, and the cost model predicts it."""
    from hf_contextpar.plan.costmodel import Shape, predict_ttft, traffic_per_rank
    from hf_contextpar.plan.machine import Machine
    from hf_contextpar.plan.strategies import STRATEGIES, Strategy

    ring = STRATEGIES["ring_pass_kv"]
    toy = Strategy(
        "toy_ring",
        "ring pass-KV without overlap",
        brings_kv="all",
        time=lambda c: (
            (c.N - 1) * (c.attention / c.N + c.message((c.T + c.kept) / c.N * c.kv_token)) + c.attention / c.N
        ),
        traffic=ring.traffic,  # the same blocks travel
        algorithm="toy_strategy:toy_ring",
    )
    monkeypatch.setitem(STRATEGIES, "toy_ring", toy)
    for kind in ("fresh", "partial", "after_batched"):
        for n, heads in ((2, "gqa"), (3, "mla"), (4, "mha")):
            check_case(Case("toy_ring", "toy_ring", kind), n, 4 * n + 3, heads, "pad", torch.float64, 1e-12)
    shape, m = Shape(4, 8, 2, 64, 1 << 20, 2), Machine.resolve(None, "cpu")
    no_overlap, overlap = predict_ttft("toy_ring", 4096, 4, shape, m), predict_ttft("ring_pass_kv", 4096, 4, shape, m)
    assert no_overlap > overlap
    assert traffic_per_rank("toy_ring", 4096, 0, 4, shape) == traffic_per_rank("ring_pass_kv", 4096, 0, 4, shape)


@pytest.mark.parametrize("seed", range(8))
def test_random_forward_sequences(seed):
    """Random turns (prefills of any length, decode steps, batched decode, replicated decode), random
    prefill strategies and masks: every forward of the sequence against whole-sequence attention."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n = rng.choice([2, 3, 4, 5])
    batch = rng.choice([1, n - 1, n, n + 2])
    strategies = ["ring_pass_kv", "ring_pass_q", "allgather_kv", "kv_runahead"] + (["ulysses"] if n in (2, 4) else [])
    layout, plans, past = ShardLayout(0, n), [], 0
    padding = make_padding(batch, 200, gen) if rng.random() < 0.5 else None
    for _ in range(8):
        num_new = rng.choice([1, 1, 1, 2, n - 1, n, 2 * n - 1, 2 * n + 1, 13])
        strategy = rng.choice(strategies)
        policy = Policy(
            n,
            decode=rng.choice(["auto", "replicated"]),
            prefill=fixed(strategy),
            partitions=lambda t, p: partition_sizes(t, [rng.random() + 0.2 for _ in range(n)]),
        )
        pad = padding[:, : past + num_new] if padding is not None else None
        plan = build_plan(
            policy,
            layout,
            batch=batch,
            num_new=num_new,
            position_ids=torch.arange(past, past + num_new).expand(batch, -1),
            padding=pad if pad is not None and not bool(pad.all()) else None,
        )
        layout.commit(plan.storage)
        plans.append(plan)
        past += num_new
    window = rng.choice([None, max(1, past // 3)])
    softcap = rng.choice([None, SOFTCAP])
    heads = (4, 4) if n == 5 else (8, 4)  # Ulysses (N = 2, 4) needs N | H_kv
    check_plans(plans, random_qkv(plans, heads, torch.float64, "cpu", gen), padding, window, softcap, 1e-12)


# -- the tests can fail: deliberately broken algorithms and messages ---------------------------
def test_a_skipped_last_ring_hop_fails(monkeypatch):
    """ring_pass_kv that never attends the block of its last hop must not pass."""
    real, seen = ring_pass_kv_module.attend, threading.local()

    def attend_all_but_last(*args, **kwargs):
        seen.calls = getattr(seen, "calls", 0) + 1
        return None if seen.calls == 3 else real(*args, **kwargs)  # N = 3: the third block is the last hop

    monkeypatch.setattr(ring_pass_kv_module, "attend", attend_all_but_last)
    with pytest.raises(AssertionError, match="out differs"):
        check_case(CASES[0], 3, 16, "gqa", "causal", torch.float64, 1e-12)


def test_a_wrong_message_size_is_an_error(monkeypatch):
    """A receive sized from the wrong rank's key count is reported, not silently truncated."""
    monkeypatch.setattr(
        step_module.LayerStep,
        "kv_size",
        lambda self, r: self.forward.plan.shards.kv_size((r + 1) % self.forward.plan.world),
    )
    with pytest.raises(SimulationError, match="ring_shift receive #"):
        check_case(CASES[0], 3, 16, "gqa", "causal", torch.float64, 1e-12)


def _world_run(n, body, timeout=0.5):
    return SimulatedWorld(n, timeout=timeout).run([body] * n)


def test_a_missing_send_times_out_instead_of_hanging():
    def body(comm):
        if comm.rank == 0:
            comm.recv_prev((4,), torch.float32, "cpu").wait()

    with pytest.raises(SimulationError, match="deadlock"):
        _world_run(2, body)


def test_a_send_waited_before_the_peer_posts_its_receive_deadlocks():
    """As under NCCL: rank 0 waits for its send while rank 1 waits in a collective before receiving."""

    def body(comm):
        if comm.rank == 0:
            comm.send_next(torch.ones(3)).wait()
            comm.all_gather(torch.ones(1))
        else:
            comm.all_gather(torch.ones(1))
            comm.recv_prev((3,), torch.float32, "cpu").wait()

    with pytest.raises(SimulationError, match="still waiting"):  # either side may time out first
        _world_run(2, body)


def test_a_message_never_received_is_an_error():
    def body(comm):
        if comm.rank == 0:
            comm.send_next(torch.ones(3))  # posted, never waited, never received

    with pytest.raises(SimulationError, match="never received"):
        _world_run(2, body)


def test_mismatched_collectives_are_an_error():
    def body(comm):
        if comm.rank == 0:
            comm.all_gather(torch.ones(2))
        else:
            comm.all_to_all([torch.ones(1)] * 2, [(1,)] * 2)

    with pytest.raises(SimulationError, match="collective #0"):
        _world_run(2, body)
