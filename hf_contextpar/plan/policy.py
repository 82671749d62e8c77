"""The prefill policy: which strategy a prefill runs, why, and how its contiguous partitions are cut.

A plan (forward.py) asks its `Policy` two things of a prefill of T new tokens over P cached ones: the strategy
(`Policy.prefill`, a `PrefillDecision`: the strategy and why) and, for contiguous partitions a strategy may cut
unevenly, their sizes (`Policy.partitions`). It keeps the answer, with the sizes it cut, in `ForwardPlan.decision`,
so whoever asks afterwards what a prefill ran (`get_runtime(model).last_decision`) reads what was decided, not a
second derivation of it.

`PrefillPolicy` makes that `Policy` for one patched model from the agreed settings and the model's facts (its
shape, its recurrent chain, its indexer, its approximate mode) and holds what was measured to size balanced
partitions (`MeasuredWork`). It reads replicated values only, so every rank decides the same; its one collective,
after a measured prefill, all-gathers every rank's busy time (`measure`), so every rank fits the same measurements.

strategy="auto" weighs the records of strategies.py by their flags and formulas, never by their names: the
candidates are the exact prefill strategies flagged `auto` whose partitions are the model's (contiguous ones where
recurrent states chain down the ranks, head-tail ones otherwise) and, where an indexer picks keys per query (DSA),
that keep each query on its rank; one candidate is the decision, several are weighed by the planner's rule
(choice.choose: each candidate's `time` formula over the cost model's terms).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .choice import Decision, choose
from .costmodel import Shape
from .partitions import MeasuredWork, balanced, key_pairs, weighted
from .strategies import STRATEGIES, Strategy


@dataclass(frozen=True)
class PrefillDecision:
    """What the policy decided for one prefill: the strategy and why; the plan adds the partitions it cut."""

    strategy: str
    why: str
    planner: Decision | None = None  # strategy="auto" weighing several candidates: the planner's Decision
    partitions: tuple | None = None  # contiguous partitions: the sizes cut, in rank order (None: head-tail shards)


def fixed(strategy: str, why: str = "asked for") -> Callable[[int, int], PrefillDecision]:
    """A policy's prefill answer that is always `strategy` (a fixed strategy=, a test's plan)."""
    decision = PrefillDecision(strategy, why)
    return lambda num_new, past: decision


@dataclass(frozen=True)
class Policy:
    """The settings a plan depends on, agreed by every rank at apply time."""

    world: int
    decode: str = "auto"  # "auto", "replicated" or "ring_pass_q"
    prefill: Callable[[int, int], PrefillDecision] = fixed("ring_pass_kv", "the default")  # (T, P) -> decision
    partitions: Callable[[int, int], list] | None = None  # (T, P) -> contiguous partition sizes (None: even)
    interleave: int = 1  # decode tokens stored per rank before the next rank takes over
    chain: bool = False  # recurrent layers: contiguous partitions of at least 2 tokens in order, replicated decode
    rebalance: bool = False  # uneven contiguous partitions commit an even share of the K/V per rank (not under DCP)


def candidates(*, chain: bool, indexed: bool) -> list[Strategy]:
    """The records strategy="auto" weighs for a model (see the module's docstring), in registration order."""
    return [
        s
        for s in STRATEGIES.values()
        if s.prefill and s.auto and not s.approximate and s.contiguous == chain and not (indexed and s.moves_queries)
    ]


class PrefillPolicy:
    """One patched model's prefill policy: makes the plan's `Policy` per settings value and keeps what was measured.

    shape: the cost model's view of the model; attention_layers: how many layers attend (balanced partitions'
    attention term); chain: recurrent layers pass their states down the ranks; indexed: indexed attention (DSA);
    sparse: the approximate mode's run (sparse.csa.SparseRun) or None; measured: the ranks may measure their busy
    times (not under TP, whose peers of one CP rank must cut the same partitions and would each measure their own);
    rebalance: uneven partitions commit an even share of the K/V (not under DCP)."""

    def __init__(self, world: int, shape: Shape, attention_layers: int, *, chain, indexed, sparse, measured, rebalance):
        self.world, self.shape, self.attention_layers = world, shape, attention_layers
        self.chain, self.indexed, self.sparse = chain, bool(indexed), sparse
        self.measured, self.rebalance = measured, rebalance
        self.candidates = candidates(chain=chain, indexed=self.indexed)
        self.work = MeasuredWork()  # balanced partitions' two terms as measured (`balanced`)
        self._made = (None, None)  # (the settings value, the Policy made for it)

    def of(self, settings) -> Policy:
        """The plan's Policy under `settings`: made once per settings value (a tool that re-plans swaps them whole)."""
        if self._made[0] is not settings:
            self._made = (settings, self._policy(settings))
        return self._made[1]

    def _policy(self, settings) -> Policy:
        sizes = None  # even
        if self.balanced(settings):
            sizes = functools.partial(self._balanced, settings)
        elif settings.partition_table is not None:  # KVR-P
            sizes = functools.partial(self._from_table, settings.partition_table)
        decode = "replicated" if self.indexed else settings.decode  # batched pass-Q decode moves queries (refused)
        return Policy(
            self.world,
            decode,
            functools.partial(self._decide, settings),
            sizes,
            settings.kv_interleave,
            chain=self.chain,
            rebalance=self.rebalance,
        )

    @staticmethod
    def balanced(settings) -> bool:
        """KV-Runahead's, CSA's and a chain's partitions by default ("balanced" or None): of equal work
        (partitions.balanced), measured as prefills run (MeasuredWork), because causal attention gives the last of
        even partitions the most work and the others wait for it in the output gather. "even" (KVR-E) and a table
        (KVR-P) only when asked; read from each settings value, so a search's tables (which swap them in) win."""
        return settings.partitions in (None, "balanced")

    def _decide(self, settings, num_new: int, past: int) -> PrefillDecision:
        if self._approximate(past):
            return PrefillDecision(self.sparse.strategy, "sparse= asks for an approximate fresh prefill")
        if settings.strategy != "auto":
            return PrefillDecision(settings.strategy, "strategy= asked for it")
        if len(self.candidates) == 1:
            return PrefillDecision(self.candidates[0].name, self._only_candidate())
        rule = settings.planner_rule
        d = choose(num_new, past, self.world, self.shape, settings.calibration, rule, self.candidates)
        return PrefillDecision(d.strategy, f"strategy='auto': the planner's {rule!r} rule", planner=d)

    def _only_candidate(self) -> str:
        if self.chain:
            return "strategy='auto': the one exact strategy with contiguous partitions, as the recurrent states go"
        if self.indexed:
            return "strategy='auto': the one candidate that keeps each query (and its top-k) on its rank"
        return "strategy='auto': the one candidate"

    def _approximate(self, past: int) -> bool:
        return self.sparse is not None and past == 0  # asked for: a fresh prefill runs approximate (CSA)

    def _balanced(self, settings, num_new: int, past: int) -> list[int]:
        """Contiguous partitions of equal work: a token's, plus a term per key its queries see, as measured. Under
        CSA a query sees only the kept keys of an earlier partition at the pruning layers (`pair_weights`), and the
        terms are the cost model's, never the measured scales: CSA's answer depends on its partitions, so the same
        prompt must cut the same way in every run (and in its one-process reference)."""
        per_token, per_pair = self.work_terms(settings)
        if self._approximate(past):
            weights = self.sparse.pair_weights(self.world, self.attention_layers)
            return weighted(num_new, self.world, per_token, per_pair, weights)
        a, b = self.work.scales()
        return balanced(num_new, self.world, past, a * per_token, b * per_pair)

    def _from_table(self, table, num_new: int, past: int) -> list[int]:
        return table.sizes(num_new, self.world)

    def partitions(self, settings, num_new: int, past: int = 0) -> list[int] | None:
        """The contiguous partition sizes a prefill of num_new new tokens over `past` would cut under `settings`
        (None: the default, even); no collective."""
        sizes = self.of(settings).partitions
        return sizes(num_new, past) if sizes is not None else None

    def work_terms(self, settings) -> tuple[float, float]:
        """The cost model's seconds per token (its linear layers) and per key a query sees, at the agreed
        calibration's rates."""
        s, cal = self.shape, settings.calibration
        gemm = cal.gemm_flops if math.isfinite(cal.gemm_flops) else cal.attn_flops  # uncalibrated: one rate
        return 2 * s.layers * s.linear_weights / gemm, 4 * s.heads * s.head_dim * self.attention_layers / cal.attn_flops

    def start(self, settings, plan, comm):
        """Where this forward's busy time teaches balanced partitions (a balanced prefill on partitions the policy
        sized, where the ranks may measure, and not an approximate one, cut from the model's terms alone): when it
        started and the seconds its rank had waited so far; None where it does not."""
        if not self.balanced(settings) or not plan.sized or not self.measured:
            return None
        if STRATEGIES[plan.algorithm].approximate:
            return None
        return time.perf_counter(), comm.stats.wait_s

    def measure(self, settings, plan, started: tuple, comm, device) -> None:
        """After a measured prefill: every rank's busy seconds (its waits excluded) beside the model's two terms for
        its partition, all-gathered (comm: the rank's communicator, its "control" tag), so every rank fits the same
        `MeasuredWork` and cuts the same partitions next."""
        busy = time.perf_counter() - started[0] - (comm.stats.wait_s - started[1])
        rows = plan.shards.token_rows[comm.rank]
        start, end = int(rows[0]), int(rows[-1]) + 1
        per_token, per_pair = self.work_terms(settings)
        mine = [per_token * (end - start), per_pair * key_pairs(start, end, plan.past), busy]
        mine = torch.tensor(mine, dtype=torch.float64, device=device)
        self.work.add(comm.all_gather(mine, "control").tolist())
