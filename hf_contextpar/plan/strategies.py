"""Every attention algorithm as one record: what it moves, what the plan must give it, and its formulas.

A strategy is one algorithm file in `attention/` (a function of (step, local Q, this rank's K/V block)
returning (out, LSE)) and one `Strategy` record here. Everything else reads the record: the plan
(contiguous partitions, rebalancing, what runs over a cache), the attention registry (which function,
whether its block may be a view of the cache), the cost model (`time`), `predict` and the tests
(`traffic`), `apply_context_parallel`'s choices and head checks, the self-test and the census.

The formulas are pure: `time` combines one layer's terms from the cost model (`costmodel.LayerCost`:
one rank's attention, a message's time, ...) and `traffic` one rank's message sizes (`Rows`), so the
cost model's average traffic and the tests' exact per-rank bytes are the same formula. This is the
pattern of PyTorch's `_context_parallel` (one enum value and one factory entry per rotate method),
kept as data so that adding a strategy touches no other module.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Rows:
    """One layer's message sizes as one rank sees them: per rank, the K/V tokens of its block and its
    query tokens; the bytes of one token's K/V, query and partial (out, LSE) for the whole batch."""

    rank: int
    kv: list  # per rank: tokens (slots) in its K/V block
    q: list  # per rank: its query tokens
    kv_row: float
    q_row: float
    part_row: float
    batch: int = 1
    seqs: list | None = None  # batched decode: per rank, how many sequences it runs
    new: int = 1  # replicated decode: new tokens per sequence
    kept: Callable | None = None  # CSA: (s, d) -> slots of rank s's block as it travels to rank d (None: kv[s])

    @property
    def world(self) -> int:
        return len(self.kv)


@dataclass(frozen=True)
class Strategy:
    """One attention algorithm. `prefill`: a value of apply_context_parallel's strategy= (else the plan
    picks it for decode). The flags are what the plan and the runtime must know of it."""

    name: str
    summary: str
    prefill: bool = True
    # whose new K/V it brings a rank: "all" ranks' or the "earlier" ones'; then uneven contiguous partitions can
    # still commit 1/N of the K/V per rank (forward._rebalanced); None: it moves no token's K/V
    brings_kv: str | None = None
    # its contiguous partitions may be uneven though it cannot rebalance the K/V: each rank stores its own (CSA)
    stores_own_partition: bool = False
    contiguous: bool = False  # needs contiguous partitions in rank order (sharding.contiguous_plan)
    fresh_only: bool = False  # runs on fresh prompts only: over a non-empty cache the plan runs `over_cache`
    over_cache: str | None = None
    over_tables: str | None = None  # after batched decode (per-sequence key tables) the plan runs this instead
    modelled_over_cache: bool = True  # False: the cost model predicts fresh prompts only
    whole_heads: bool = False  # moves whole heads: N must divide the query and the KV heads
    stays_local: bool = False  # its K/V never leave the rank: it may read a view of the cache
    returns_lse: bool = True  # False: its output is final (nothing merges it after)
    posts_ahead: bool = False  # posts the next layer's receives during this one (tests run two layers)
    approximate: bool = False  # not the exact result: run only where asked (sparse=), never a value of strategy=
    # queries leave the rank that ran them (pass-Q, Ulysses): a per-query selection made there (indexed attention's
    # top-k) does not go with them, so a model with indexed attention refuses it
    moves_queries: bool = False
    # strategy="auto" weighs it (plan/policy.py): among the candidates whose partitions are the model's, by `time`
    auto: bool = False
    time: Callable | None = None  # (LayerCost) -> one layer's attention seconds with its messages, or None
    traffic: Callable | None = None  # (Rows) -> bytes (sent, received) of one layer on that rank
    algorithm: str = ""  # "module:function" (a module relative to hf_contextpar.attention); "": ".{name}:{name}"

    @property
    def cuts_unevenly(self) -> bool:
        """Its contiguous partitions may be cut unevenly (the policy's sizes): it rebalances the K/V, or stores its own."""
        return self.brings_kv is not None or self.stores_own_partition

    def load(self) -> Callable:
        """The algorithm's function (imported here, so the plan never imports the attention package)."""
        module, _, function = (self.algorithm or f".{self.name}:{self.name}").partition(":")
        return getattr(importlib.import_module(module, "hf_contextpar.attention"), function)


def _ring_kv_time(c) -> float:
    return (c.N - 1) * max(c.attention / c.N, c.message((c.T + c.kept) / c.N * c.kv_token)) + c.attention / c.N


def _ring_q_time(c) -> float:
    return (c.N - 1) * max(c.attention / c.N, c.message(c.T / c.N * c.q_token)) + c.attention / c.N + c.all2all


def _runahead_time(c) -> float | None:
    """Balanced partitions (the default, `partitions.balanced`): every rank does an equal share of the work,
    its tokens' linear layers (counted as T/N tokens beside this) plus its queries' keys, so the last rank
    attends the even share of the layer's attention; plus the N-1 hops of the growing prefix chain, sized
    as even partitions' (balanced ones send a little more: their earlier partitions are larger)."""
    chunk = c.T / c.N
    return c.attention + sum(c.message(i * chunk * c.kv_token) for i in range(1, c.N))


def _csa_time(c) -> float | None:
    """CSA's chain (`LayerCost.csa`: its partitions, balanced by default, and the keys each block keeps at its
    destination's level on this layer): every rank the same work, so the layer's attention over the kept keys
    divided by N, overlapped with the blocks its incoming link carries one after the other, each at that link's
    rate (inside a node or between nodes, `LayerCost.hop`). The pipeline's fill (a block's N - 1 hops) is left
    out: one block's time on the slowest link, small beside the rest at these sizes."""
    if c.csa is None:
        return None
    sizes, kept = c.csa.sizes, c.csa.kept
    pairs = sum(n * (n + 1) / 2 + n * sum(kept(s, d) for s in range(d)) for d, n in enumerate(sizes))
    work = 4.0 * c.shape.heads * c.shape.head_dim * pairs / c.m.attn_flops / c.N
    links = [sum(c.hop(d - 1, d, kept(s, d) * c.kv_token) for s in range(d)) for d in range(1, c.N)]
    return max(work, max(links, default=0.0))


def _csa_traffic(r: Rows) -> tuple:  # the chain's, each block cut to the slots its next rank's level keeps
    kept = r.kept or (lambda s, d: r.kv[s])
    sent = sum(kept(s, r.rank + 1) for s in range(r.rank + 1)) * r.kv_row if r.rank < r.world - 1 else 0
    return sent, sum(kept(s, r.rank) for s in range(r.rank)) * r.kv_row


def _ulysses_time(c) -> float:
    chunk = c.T / c.N
    qkv = (c.N - 1) / c.N * chunk * (c.q_token + c.kv_plain) / c.bandwidth
    out = (c.N - 1) / c.N * chunk * c.q_token / c.bandwidth
    return 2 * c.latency + qkv + out + c.attention


def _ring_kv_traffic(r: Rows) -> tuple:  # every block but the next rank's leaves, every block but ours arrives
    nxt, total = (r.rank + 1) % r.world, sum(r.kv)
    return (total - r.kv[nxt]) * r.kv_row, (total - r.kv[r.rank]) * r.kv_row


def _ring_q_traffic(r: Rows) -> tuple:  # queries travel N-1 hops; partials for the other ranks' queries go home
    nxt, total, mine = (r.rank + 1) % r.world, sum(r.q), r.q[r.rank]
    sent = (total - r.q[nxt]) * r.q_row + (total - mine) * r.part_row
    return sent, (total - mine) * r.q_row + (r.world - 1) * mine * r.part_row


def _allgather_traffic(r: Rows) -> tuple:  # our block to N-1 ranks; every other block to us
    return (r.world - 1) * r.kv[r.rank] * r.kv_row, (sum(r.kv) - r.kv[r.rank]) * r.kv_row


def _runahead_traffic(r: Rows) -> tuple:  # rank i forwards blocks 0..i to rank i+1
    sent = sum(r.kv[: r.rank + 1]) * r.kv_row if r.rank < r.world - 1 else 0
    return sent, sum(r.kv[: r.rank]) * r.kv_row


def _ulysses_traffic(r: Rows) -> tuple:  # 1/N of the heads: our Q and K/V out, their tokens' outputs back
    n, mine_q, mine_kv = r.world, r.q[r.rank], r.kv[r.rank]
    others_q, others_kv = sum(r.q) - mine_q, sum(r.kv) - mine_kv
    sent = (n - 1) * (mine_q * r.q_row + mine_kv * r.kv_row) + others_q * r.q_row
    recv = others_q * r.q_row + others_kv * r.kv_row + (n - 1) * mine_q * r.q_row
    return sent / n, recv / n  # whole heads: n divides every term


def _decode_traffic(r: Rows) -> tuple:  # one all-gather of the packed (out, LSE) of the replicated queries
    both = (r.world - 1) * r.new * r.part_row
    return both, both


def _ring_q_decode_traffic(r: Rows) -> tuple:  # one query per sequence travels; partials come home
    rows, nxt = r.seqs, (r.rank + 1) % r.world
    one_q, one_part = r.q_row // r.batch, r.part_row // r.batch
    sent = (r.batch - rows[nxt]) * one_q + (r.batch - rows[r.rank]) * one_part
    return sent, (r.batch - rows[r.rank]) * one_q + (r.world - 1) * rows[r.rank] * one_part


STRATEGIES: dict[str, Strategy] = {}


def register(strategy: Strategy) -> Strategy:
    """Add a strategy (an algorithm the library ships, or a test's own); a name is taken once."""
    if strategy.name in STRATEGIES or strategy.name == "auto":
        raise ValueError(f"a strategy named {strategy.name!r} exists already")
    STRATEGIES[strategy.name] = strategy
    return strategy


for _s in (
    Strategy(
        "ring_pass_kv",
        "Meta Alg. 2: K/V blocks travel the ring, overlapped with attention",
        brings_kv="all",
        auto=True,
        time=_ring_kv_time,
        traffic=_ring_kv_traffic,
    ),
    Strategy(
        "ring_pass_q",
        "Meta Alg. 3: query blocks travel the ring; partial outputs go home by All2All",
        stays_local=True,
        moves_queries=True,
        auto=True,
        time=_ring_q_time,
        traffic=_ring_q_traffic,
    ),
    Strategy(
        "allgather_kv",
        "Llama 3 / vLLM: all-gather every rank's K/V, then attend",
        brings_kv="all",
        time=lambda c: c.message((c.N - 1) * (c.T + c.kept) / c.N * c.kv_token) + c.attention,
        traffic=_allgather_traffic,
    ),
    Strategy(
        "kv_runahead",
        "KV-Runahead: contiguous partitions, the K/V prefix passed down a point-to-point chain",
        brings_kv="earlier",
        contiguous=True,
        fresh_only=True,
        over_cache="ring_pass_kv",
        posts_ahead=True,
        auto=True,  # the candidate of a model whose recurrent states chain down the ranks: one way, as they go
        time=_runahead_time,
        traffic=_runahead_traffic,
    ),
    Strategy(
        "ulysses",
        "DeepSpeed-Ulysses / CSPS SP-NTP: All2All to head shards, attend whole sequences, All2All back",
        over_tables="allgather_kv",
        modelled_over_cache=False,
        whole_heads=True,
        moves_queries=True,
        returns_lse=False,
        time=_ulysses_time,
        traffic=_ulysses_traffic,
    ),
    Strategy(
        "csa",
        "CSPS CSA (approximate, sparse=CSA(...)): contiguous partitions, K/V pruned by level down a chain",
        approximate=True,
        moves_queries=True,  # its own pruning, not an indexer's selection
        contiguous=True,
        stores_own_partition=True,
        fresh_only=True,
        over_cache="ring_pass_kv",
        posts_ahead=True,
        time=_csa_time,
        traffic=_csa_traffic,
    ),
    Strategy(
        "replicated_decode",
        "fewer sequences than ranks: every rank runs the new tokens over its slice of the cache",
        prefill=False,
        stays_local=True,
        returns_lse=False,
        traffic=_decode_traffic,
        algorithm=".decode:replicated_decode",
    ),
    Strategy(
        "ring_pass_q_decode",
        "Meta Alg. 4: batched decode, each rank runs B/N sequences, queries travel the ring",
        prefill=False,
        moves_queries=True,
        stays_local=True,
        traffic=_ring_q_decode_traffic,
    ),
    Strategy(
        "local",
        "no cache and prompts shorter than N: every rank attends the whole forward alone",
        prefill=False,
        stays_local=True,
        traffic=lambda r: (0, 0),
    ),
):
    register(_s)


def prefill_names() -> tuple:
    """The values of strategy= besides "auto", in registration order."""
    return tuple(name for name, s in STRATEGIES.items() if s.prefill and not s.approximate)
