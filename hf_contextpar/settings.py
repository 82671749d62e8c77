"""What apply_context_parallel was asked, as one frozen value.

`Settings.of(...)` checks the caller's arguments (no file is read: on one process apply changes
nothing), `resolved()` reads what they name on this rank once the process group exists (the
calibration file, a KV-Runahead partition table: a rank that fails there leaves its peers a
`PeerFailureError` at the agreement, not a hang), and `comm/agreement.agree_settings` compares
every rank's and hands every rank rank 0's machine facts, so the runtime is built from one agreed
value and nothing sets it afterwards (a tool that re-plans, as `calibrate` does, replaces it whole).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .plan.choice import RULES, Calibration
from .plan.partitions import PartitionTable
from .plan.strategies import STRATEGIES, prefill_names
from .sparse.csa import CSA

DECODES = ("auto", "replicated", "ring_pass_q")
PLANNER_RULES = RULES
PARTITION_MODES = (None, "even", "balanced")


@dataclass(frozen=True)
class Settings:
    strategy: str = "auto"  # a registered prefill strategy (plan/strategies.py) or "auto"
    decode: str = "auto"
    planner_rule: str = "cost"
    check_inputs: bool = True
    kv_interleave: int = 1
    partitions: str | None = None  # None, "even", "balanced", or "table" (then `partition_table`)
    sparse: CSA | None = None  # an approximate mode, asked for (never a default); its topology resolved at apply
    # machine facts: as given, then this rank's (`resolved`), then rank 0's (the agreement)
    calibration: Calibration | dict | str | None = field(default=None, compare=False)
    partition_table: PartitionTable | dict | str | None = field(default=None, compare=False)

    @classmethod
    def of(
        cls,
        *,
        strategy="auto",
        decode="auto",
        planner_rule="cost",
        check_inputs=True,
        kv_interleave=1,
        partitions=None,
        calibration=None,
        sparse=None,
    ) -> Settings:
        """The caller's arguments, checked (a ValueError that says what is accepted); `resolved` reads them."""
        if strategy != "auto" and strategy not in prefill_names():
            raise ValueError(f"strategy must be one of {('auto', *prefill_names())}, got {strategy!r}.")
        if decode not in DECODES:
            raise ValueError(f"decode must be one of {DECODES}, got {decode!r}.")
        if planner_rule not in PLANNER_RULES:
            raise ValueError(f"planner_rule must be one of {PLANNER_RULES}, got {planner_rule!r}.")
        if isinstance(kv_interleave, bool) or not isinstance(kv_interleave, int) or kv_interleave < 1:
            raise ValueError(
                f"kv_interleave must be a positive int (decode tokens stored per rank before the next rank takes "
                f"over; 1 = token by token), got {kv_interleave!r}."
            )
        if sparse is not None and not isinstance(sparse, CSA):
            raise ValueError(f"sparse must be None or hf_contextpar.sparse.CSA(...), got {sparse!r}.")
        fixed = isinstance(partitions, str) and partitions in PARTITION_MODES or partitions is None
        return cls(
            strategy=strategy,
            decode=decode,
            planner_rule=planner_rule,
            check_inputs=bool(check_inputs),
            kv_interleave=kv_interleave,
            partitions=partitions if fixed else "table",
            calibration=calibration,
            partition_table=None if fixed else partitions,
            sparse=sparse,
        )

    def resolved(self, device_type: str, world: int) -> Settings:
        """The calibration (a Calibration, dict, JSON path, or the saved file / defaults), the partition
        table (a PartitionTable, dict or JSON path) and an approximate mode's topology, read on this rank."""
        table = PartitionTable.load(self.partition_table) if self.partition_table is not None else None
        sparse = self.sparse.resolved(world) if self.sparse is not None else None
        calibration = Calibration.resolve(self.calibration, device_type)
        return replace(self, calibration=calibration, partition_table=table, sparse=sparse)

    @property
    def whole_heads(self) -> bool:
        """The strategy moves whole heads (Ulysses): N must divide the heads, a latent cannot be split."""
        return self.strategy != "auto" and STRATEGIES[self.strategy].whole_heads

    def compared(self) -> dict:
        """What every rank must have been given the same (the machine facts are taken from rank 0)."""
        return dict(
            strategy=self.strategy,
            decode=self.decode,
            planner_rule=self.planner_rule,
            check_inputs=self.check_inputs,
            kv_interleave=self.kv_interleave,
            partitions=self.partitions,
            sparse=self.sparse.describe() if self.sparse is not None else None,
        )

    def facts(self) -> tuple:
        return self.calibration, self.partition_table

    def with_facts(self, facts: tuple) -> Settings:
        calibration, table = facts
        return replace(self, calibration=calibration, partition_table=table)
