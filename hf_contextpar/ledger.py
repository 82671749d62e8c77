"""What the forwards of one patched model ran: the algorithm, the tokens, the attention bytes, the plan and the
latest prefill's decision, read through `get_runtime(model)` by the user, the tests and the benchmarks.

The runtime's hooks write it, one entry per forward (`begin` when the forward starts, `end` when it finishes); nothing
the library runs reads it back.
"""

from __future__ import annotations

from collections import Counter

from .plan.forward import ForwardPlan
from .plan.strategies import STRATEGIES


class ForwardLog:
    """One patched model's record of its forwards."""

    def __init__(self):
        self.algorithm_counts = Counter()  # forwards run per attention algorithm (for tests, benchmarks)
        self.approximate = Counter()  # forwards run approximate, by the settings they ran with (CSA's describe())
        self.last_forward = None  # algorithm, tokens and attention bytes of the latest forward
        self.last_plan = None
        self.last_prefill = None  # the latest prefill's PrefillDecision (plan/policy.py), as its plan kept it

    def begin(self, plan: ForwardPlan, inputs, sparse, attention) -> None:
        """A forward starts: what it runs. inputs: the contract's `Inputs`; sparse: the approximate mode (a
        sparse.csa.SparseRun) or None; attention: the communicator's "attention" counters, read again at `end`."""
        self.algorithm_counts[plan.algorithm] += 1
        approximate = sparse.csa.describe() if STRATEGIES[plan.algorithm].approximate else None
        if approximate is not None:
            self.approximate[approximate] += 1
        self.last_plan = plan
        if plan.decision is not None:  # a prefill: the plan asked the policy for its strategy
            self.last_prefill = plan.decision
        self.last_forward = dict(
            algorithm=plan.algorithm,
            tokens=inputs.num_new,
            past=inputs.past,
            bytes_sent=-attention.bytes_sent,
            bytes_received=-attention.bytes_received,
            approximate=approximate,  # None: the exact result
        )

    def end(self, attention) -> None:
        """The forward finished (or raised): the attention bytes it moved."""
        self.last_forward["bytes_sent"] += attention.bytes_sent
        self.last_forward["bytes_received"] += attention.bytes_received
