"""The specification every attention algorithm is checked against (issue 12), in ring-flash-attention's shape.

Whole-sequence Q, K, V are cut the way a plan says (`plan/forward.build_plan` over a `ShardLayout`
that went through the forwards before it), the plan's algorithm runs unmodified on N simulated
ranks (`hf_contextpar.tools.selftest.simulated`, one thread per rank), and every rank's (out, LSE) for its own
query rows must equal plain whole-sequence attention written out here (`reference`), and its
traffic must equal the analytical bytes (`expected_traffic`: the formulas of
tests/workers/strategy_worker.py, which the multi-process tests check against the real `Comm`,
generalised to batch, partial prefill and decode).

One copy for tests/*/test_algorithms.py (the CPU matrix) and `python -m hf_contextpar selftest
--simulated` (the same cases on whatever device is present, one GPU included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...attention.masks import Chunked
from ...cache.sharded import ShardLayout
from ...plan.forward import build_plan
from ...plan.policy import Policy, fixed
from ...plan.strategies import STRATEGIES, Rows
from .simulated import local_rows, run_algorithm, shard_inputs

HEAD_DIM = 8
SCALE = 0.3  # not 1/sqrt(D): an algorithm that drops `scale` must fail
SOFTCAP = 1.5
HEADS = {"gqa": (8, 2), "mha": (4, 4), "mla": (4, 1)}
# "mla", multi-head latent attention: a token caches a latent and a RoPE part (one "head"), which expand to
# every query head's keys (NOPE + ROPE wide) and values (VALUE wide, narrower than the keys)
LATENT, ROPE, NOPE, VALUE = 12, 4, 8, 6
# (dtype, tolerance on every rank's out and LSE) per device type. CUDA: the kernel swap's tolerances
# (kernels.cuda_kernel_ok); bf16 also rounds each block's output to 8 bits, fp16 to 11.
DTYPES = {
    "cpu": {
        "fp64": (torch.float64, 1e-12),
        "fp32": (torch.float32, 1e-5),
        "bf16": (torch.bfloat16, 2e-2),
        "fp16": (torch.float16, 1e-2),
    },
    "cuda": {"bf16": (torch.bfloat16, 2e-2), "fp16": (torch.float16, 1e-2), "fp32": (torch.float32, 1e-4)},
}


@dataclass(frozen=True)
class Case:
    """One way of reaching a forward: the layout's history, then the tested forward(s)."""

    name: str
    algorithm: str  # what the tested plan must run
    kind: str  # "fresh", "partial", "after_batched", "decode", "batched_decode", "local"
    uneven: bool = False  # KV-Runahead with uneven contiguous partitions (KVR-S/P)


CASES = [
    Case("ring_pass_kv", "ring_pass_kv", "fresh"),
    Case("ring_pass_q", "ring_pass_q", "fresh"),
    Case("allgather_kv", "allgather_kv", "fresh"),
    Case("kv_runahead", "kv_runahead", "fresh"),
    Case("kv_runahead_uneven", "kv_runahead", "fresh", uneven=True),
    Case("ulysses", "ulysses", "fresh"),
    Case("ring_pass_kv_partial", "ring_pass_kv", "partial"),
    Case("ring_pass_q_partial", "ring_pass_q", "partial"),
    Case("allgather_kv_partial", "allgather_kv", "partial"),
    Case("ulysses_partial", "ulysses", "partial"),
    Case("ring_pass_kv_after_batched", "ring_pass_kv", "after_batched"),
    Case("ring_pass_q_after_batched", "ring_pass_q", "after_batched"),
    Case("allgather_kv_after_batched", "allgather_kv", "after_batched"),
    Case("replicated_decode", "replicated_decode", "decode"),
    Case("ring_pass_q_decode", "ring_pass_q_decode", "batched_decode"),
    Case("local", "local", "local"),
]


def heads_for(case: Case, n: int, heads: str) -> tuple[int, int]:
    """(query heads, KV heads); Ulysses needs N to divide both, so its heads scale with N."""
    if case.algorithm == "ulysses":
        _require(heads != "mla", "Ulysses cannot split a latent by head: the attention adapter refuses it")
        return (4 * n, n) if heads == "gqa" else (n, n)
    return HEADS[heads]


def lengths(case: Case, n: int) -> list[int]:
    """T values: never divisible by N or 2N (N + 1 < 2N, 5N + 1); below N where the case needs it."""
    if case.kind == "local":
        return sorted({1, n - 1})
    return [n + 1, 5 * n + 1]


# -- the reference ---------------------------------------------------------------------------
def reference(q, k, v, valid, scale, window, softcap):
    """Whole-sequence attention in fp64 with explicit scores: q (B, H, S, D), k, v (B, Hkv, S, D),
    valid (B, S) bool or None. Key j is visible to query i iff j <= i, i - j < window (or, for a
    `masks.Chunked` window, (j - off_b) // size == (i - off_b) // size, transformers' rule) and valid[j];
    a row that sees no key has out 0 and LSE -inf. Returns out (B, H, S, D), lse (B, H, S)."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(q.shape[2], device=q.device)[:, None]
    j = torch.arange(k.shape[2], device=q.device)[None, :]
    vis = j <= i
    if window is not None and not isinstance(window, Chunked):
        vis = vis & (i - j < window)
    vis = vis[None, None]
    if isinstance(window, Chunked):
        off, size = window.offsets.to(q.device).view(-1, 1, 1, 1), window.size
        vis = vis & ((j - off).div(size, rounding_mode="floor") == (i - off).div(size, rounding_mode="floor"))
    if valid is not None:
        vis = vis & valid[:, None, None, :]
    s = s.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.where(vis, torch.exp(s - lse.unsqueeze(-1)), 0.0)
    return p @ v, lse


# -- the forwards a case goes through ---------------------------------------------------------
def plans_for(case: Case, n: int, length: int, padding):
    """(batch, tested plans, final sequence length). The history's plans are committed to the
    layout untested; every tested plan is committed too, so decode steps build on each other."""
    batch = n + 1 if case.kind in ("batched_decode", "after_batched") else 2
    prefill = "kv_runahead" if case.algorithm == "kv_runahead" else case.algorithm
    sizes = None
    if case.uneven:  # the first rank takes the most, as KVR-S finds; every rank keeps one or more
        sizes = lambda t, p: [t - (n - 1) * max(1, t // (2 * n))] + [max(1, t // (2 * n))] * (n - 1)  # noqa: E731
    policy = Policy(
        n,
        decode="replicated" if case.kind in ("partial", "decode") else "auto",
        prefill=fixed(prefill),
        partitions=sizes,
    )
    layout = ShardLayout(0, n)
    tested = []

    def forward(num_new, test, uses_cache=True):
        past = layout.seq_length if uses_cache else 0
        total = past + num_new
        pad = padding[:batch, :total] if padding is not None else None
        plan = build_plan(
            policy,
            layout if uses_cache else None,
            batch=batch,
            num_new=num_new,
            position_ids=torch.arange(past, total).expand(batch, -1),
            padding=pad if pad is not None and not bool(pad.all()) else None,
            uses_cache=uses_cache,
        )
        if test:
            tested.append(plan)
        if uses_cache:
            layout.commit(plan.storage)

    if case.kind == "fresh":
        forward(length, True)
    elif case.kind == "partial":
        forward(2 * n + 3, False)
        forward(1, False)  # uneven shards before the tested forward
        forward(length, True)
    elif case.kind == "after_batched":
        forward(2 * n + 1, False)
        for _ in range(n + 1):
            forward(1, False)
        _require(any(c.dim() == 2 for c in layout.cols), "no per-sequence column tables before the turn")
        forward(length, True)
    elif case.kind == "decode":
        if length < 2 * n:  # a prompt shorter than N is itself run replicated
            forward(n - 1, True)
        else:
            forward(length, False)
        for num_new in (1, max(1, n - 1), 1):
            forward(num_new, True)
    elif case.kind == "batched_decode":
        forward(length, False)
        for _ in range(n + 2):
            forward(1, True)
    else:  # local: no cache
        forward(length, True, uses_cache=False)
    final = max(p.seq_length for p in tested)
    return batch, tested, final


def make_padding(batch: int, total: int, gen) -> torch.Tensor:
    """Left padding (rows 0 and 2 mod 3) and holes (rows 1 mod 3); the first query of a left-padded
    row sees no key at all."""
    valid = torch.ones(batch, total, dtype=torch.bool)
    for b in range(batch):
        left = [2, 0, 1][b % 3]
        valid[b, : min(left, total - 1)] = False
        if b % 3 == 1:
            valid[b] &= torch.rand(total, generator=gen) > 0.3
    return valid


# -- traffic ------------------------------------------------------------------------------------
def expected_traffic(plan, rank, heads, kv_heads, e, pe, latent=False):
    """Bytes (sent, received) of one layer on `rank`: tests/strategy_worker.expected_bytes, generalised
    to batch B, per-rank key counts kv_size(r) (partial prefill, per-sequence tables) and decode.
    e: bytes per element of Q/K/V; pe: of the partial (out, LSE) (fp32, fp64 for fp64 models).
    latent: a token's K/V is its cached latent and RoPE part, never the expanded heads."""
    n, b, d = plan.world, plan.batch, HEAD_DIM
    kv = [plan.shards.kv_size(r) for r in range(n)]
    qn = [c.numel() for c in plan.shards.q_cols]
    kv_row, q_row, part_row = 2 * b * kv_heads * d * e, b * heads * d * e, b * heads * (d + 1) * pe
    if latent:  # queries NOPE + ROPE wide, outputs VALUE wide
        d = VALUE
        kv_row, q_row, part_row = b * (LATENT + ROPE) * e, b * heads * (NOPE + ROPE) * e, b * heads * (d + 1) * pe
    seqs = [len(range(b)[s]) for s in plan.shards.seq_rows] if plan.shards.seq_rows is not None else None
    rows = Rows(rank, kv, qn, kv_row, q_row, part_row, batch=b, seqs=seqs, new=plan.num_new)
    return STRATEGIES[plan.algorithm].traffic(rows)


def latent_kv(block, expand):
    """A rank's `step.LayerKV` for an MLA layer, as the attention adapter builds it from the model's own expansion."""
    from ...attention.step import LayerKV
    from ...cache.blocks import unpack_kv

    return LayerKV(LATENT, expand, expand(*unpack_kv(block, LATENT)), NOPE + ROPE, VALUE)


# -- one check ------------------------------------------------------------------------------------
def prepare(case: Case, n: int, length: int, heads: str, mask: str, dtype, device="cpu"):
    """The case's tested plans and its whole-sequence inputs: (plans, (q, k, v), padding, window, softcap)."""
    gen = torch.Generator().manual_seed(1000 * n + length)
    softcap = SOFTCAP if mask in ("softcap", "all") else None
    max_len = 12 * n + 8  # longer than any case's sequence
    # the runtime's padding mask lives on the model's device (Step.key_valid follows it)
    padding = make_padding(n + 1, max_len, gen).to(device) if mask in ("pad", "all", "chunk") else None
    batch, plans, total = plans_for(case, n, length, padding)
    window = max(1, total // 3) if mask in ("window", "all") else None  # narrow enough to cut every case
    if mask == "chunk":  # chunks counted from each sequence's first real token, as transformers counts them
        lead = (padding[:batch, :total].cumsum(-1) == 0).sum(-1) if padding is not None else torch.zeros(batch)
        window = Chunked(max(2, total // 4), lead.long().cpu())
    _require(case.algorithm in [p.algorithm for p in plans], f"{case.name}: no {case.algorithm} plan")
    if case.uneven:
        _require(len({c.numel() for c in plans[0].shards.q_cols}) > 1, "the KV-Runahead partition came out even")
    if case.kind == "batched_decode":  # the case is about per-sequence column tables
        _require(
            any(p.algorithm == case.algorithm and any(c.dim() == 2 for c in p.shards.kv_cols) for p in plans),
            f"{case.name}: no per-sequence column tables",
        )
    if heads == "mla":
        return plans, random_latent(plans, HEADS["mla"][0], dtype, device, gen), padding, window, softcap
    return plans, random_qkv(plans, heads_for(case, n, heads), dtype, device, gen), padding, window, softcap


def _rand(plans, heads, dim, dtype, device, gen, scale=1.5):
    batch, total = plans[0].batch, max(p.seq_length for p in plans)
    return (torch.randn(batch, heads, total, dim, generator=gen, dtype=torch.float64) * scale).to(device, dtype)


def random_qkv(plans, heads, dtype, device, gen):
    """Whole-sequence q (B, H, S, D), k, v (B, Hkv, S, D) over the longest plan's S."""
    return tuple(_rand(plans, h, HEAD_DIM, dtype, device, gen) for h in (heads[0], heads[1], heads[1]))


def random_latent(plans, heads, dtype, device, gen):
    """Whole-sequence q (B, H, S, NOPE + ROPE), the expanded k, v, and what is cached: (latent, rope, expand)."""
    w_k, w_v = (
        torch.randn(LATENT, heads * d, generator=gen, dtype=torch.float64).to(device, dtype) for d in (NOPE, VALUE)
    )

    def expand(latent, rope):  # as transformers' MLA modules do: per-head projections of the latent, shared RoPE
        b, _, t, _ = latent.shape
        k_nope = (latent @ w_k).view(b, t, heads, NOPE).transpose(1, 2)
        v = (latent @ w_v).view(b, t, heads, VALUE).transpose(1, 2)
        return torch.cat([k_nope, rope.expand(-1, heads, -1, -1)], dim=-1), v

    latent, rope = _rand(plans, 1, LATENT, dtype, device, gen, 0.5), _rand(plans, 1, ROPE, dtype, device, gen)
    q = _rand(plans, heads, NOPE + ROPE, dtype, device, gen, 0.5)
    return (q, *expand(latent, rope), (latent, rope, expand))


def check_case(case: Case, n: int, length: int, heads: str, mask: str, dtype, tol, device="cpu", timeout=60.0):
    """Run every tested plan of the case on n simulated ranks; assert (out, LSE) and traffic per rank."""
    plans, qkv, padding, window, softcap = prepare(case, n, length, heads, mask, dtype, device)
    check_plans(plans, qkv, padding, window, softcap, tol, timeout)


def layers_for(plan) -> int:
    """An algorithm that posts layer l+1's receives during layer l (KV-Runahead) runs for two layers."""
    return 2 if STRATEGIES[plan.algorithm].posts_ahead else 1


def check_plans(plans, qkv, padding, window, softcap, tol, timeout=60.0):
    """Run each plan (forwards of one sequence, in order) on simulated ranks against whole-sequence
    attention over the longest of them; assert every rank's (out, LSE), traffic, and that ranks
    computing the same rows agree bit for bit."""
    q, k, v, *cached = qkv
    n, batch, total, dtype = plans[0].world, plans[0].batch, q.shape[2], q.dtype
    hq, hk = q.shape[1], k.shape[1]
    latent, rope, expand = cached[0] if cached else (k, v, None)
    valid = padding[:batch, :total].to(q.device) if padding is not None else None
    ref_out, ref_lse = reference(q, k, v, valid, SCALE, window, softcap)
    e, pe = torch.tensor([], dtype=dtype).element_size(), 8 if dtype == torch.float64 else 4
    for i, plan in enumerate(plans):
        layers = layers_for(plan)
        qs, kvs = shard_inputs(plan, q, latent, rope, empty=1e3)  # empty slots hold junk: they must stay masked
        outputs, comms = run_algorithm(
            plan,
            qs,
            kvs,
            scale=SCALE,
            window=window,
            softcap=softcap,
            num_layers=layers,
            timeout=timeout,
            layer_kv=(lambda r: latent_kv(kvs[r], expand)) if expand is not None else None,
        )
        for r in range(n):
            where = f"plan {i} ({plan.algorithm}, past {plan.past}, new {plan.num_new}), rank {r}"
            want_out, want_lse = local_rows(plan, r, ref_out), local_rows(plan, r, ref_lse)
            for layer, (out, lse) in enumerate(outputs[r]):
                if out is None:  # no key visible to any row: what the attention adapter turns into zeros
                    out = torch.zeros_like(want_out)
                    lse = torch.full_like(want_lse, -math.inf) if STRATEGIES[plan.algorithm].returns_lse else None
                torch.testing.assert_close(
                    out.double(),
                    want_out,
                    atol=tol,
                    rtol=tol,
                    msg=lambda m: f"{where}, layer {layer}: out differs\n{m}",
                )
                if STRATEGIES[plan.algorithm].returns_lse:
                    torch.testing.assert_close(
                        lse.double(),
                        want_lse,
                        atol=tol,
                        rtol=tol,
                        msg=lambda m: f"{where}, layer {layer}: LSE differs\n{m}",
                    )
            sent, recv = expected_traffic(plan, r, hq, hk, e, pe, latent=expand is not None)
            attention = comms[r].tagged["attention"]  # what the runtime reports as a forward's attention bytes
            got = (attention.bytes_sent, attention.bytes_received)
            _require(
                got == (layers * sent, layers * recv),
                f"{where}: traffic {got}, expected {(layers * sent, layers * recv)}",
            )
        if plan.outputs.logits is None:  # every rank computed every row: merged in one order, so bit-identical
            for r in range(1, n):
                for (out0, lse0), (out, lse) in zip(outputs[0], outputs[r]):
                    _require(same(out, out0) and same(lse, lse0), f"plan {i}: rank {r}'s output is not rank 0's")


def _require(ok: bool, what: str):
    """An assertion that python -O keeps: the selftest's verdict rests on it."""
    if not ok:
        raise AssertionError(what)


def same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
