"""A model under context parallelism: what apply reads once, checked, and what each forward makes of it.

`PatchedModel.of` reads the model once, when apply builds the runtime: its tensor-parallel layout and DCP peers
(mesh.py), its shape for the cost model, its input contract, its recurrent layers, its indexer and its approximate
mode; it refuses what cannot run exactly before any forward (the capability record, capabilities.py;
attention/entries) and builds the prefill policy (plan/policy.py). Each forward's plan is made from it (`plan`: the
contract's checked inputs under the policy), then three objects from the plan (`begin`): the forward's context
(plan/context.py), the cache it stores into and the `Step` the attention layers read, all dropped when the forward
ends (`end`). The runtime's hooks (runtime.py) hold one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .attention import NAME as ATTENTION_NAME
from .attention.entries import check as check_entries
from .attention.indexed import Indexer
from .attention.step import Step
from .cache.recurrent import start_chain
from .capabilities import Facts
from .capabilities import check as check_capabilities
from .comm.collectives import Comm
from .mesh import check_cp_group, dcp_of, tensor_parallel
from .model.contract import InputContract, attention_layers
from .model.shape import model_shape
from .plan.context import forward_context
from .plan.costmodel import Shape
from .plan.forward import ForwardPlan, build_plan
from .plan.policy import PrefillPolicy
from .sparse.csa import SparseRun


@dataclass
class PatchedModel:
    """One patched model's facts, as its forwards read them."""

    rank: int
    world: int
    tp_group: object  # transformers' TP group (None without TP): it joins every rank agreement
    tp: int  # TP ranks: each attends with the heads it holds
    dcp: Comm | None  # DCP: the TP ranks sharing this rank's KV head, each holding every dcp-th slot
    shape: Shape
    contract: InputContract
    chain: bool  # recurrent layers (cache/recurrent.py): prefill passes their states down the ranks
    attention_layers: int  # layers that attend: balanced partitions' attention term, the coverage check's count
    indexed: frozenset  # indexed attention (DSA)'s layers: every rank's indexer scores every column
    sparse: SparseRun | None  # the approximate mode (CSA), where one was asked for
    policy: PrefillPolicy  # which strategy each prefill runs and how its partitions are cut
    capabilities: dict = field(default_factory=dict)  # capabilities.py: name -> what the forwards read of it
    kv_shapes: dict = field(default_factory=dict)  # Step.kv_shapes: the K/V block geometry forwards have shown

    @staticmethod
    def of(model, group, rank: int, world: int, settings) -> PatchedModel:
        """The model's facts under `settings` (agreed by every rank), or a typed refusal of what it cannot run."""
        tp_group, tp = tensor_parallel(model)
        check_cp_group(group, tp_group)
        shape = model_shape(model)
        dcp = dcp_of(model)  # (group, index, size) of the TP ranks sharing this rank's KV head
        contract = InputContract(model, rank, world, ATTENTION_NAME)
        recurrent = any(r.states for r in contract.recurrence)
        # each capability's refusals, in its own room (capabilities.py): whole heads, indexed attention (DSA: every
        # rank's indexer scores every column), the recurrent chain (prefill passes states down the ranks)
        capabilities = check_capabilities(Facts(model, settings, world, tp, dcp, shape, recurrent))
        chain, indexed, sparse = capabilities["chain"], capabilities["indexed"], capabilities["csa"]
        check_entries(settings, model.config.model_type, contract.recurrence)  # compressed entries (V4's)
        # a model whose cache holds states alone (RWKV, whose config lists no layer kinds) attends in no layer
        layers = attention_layers(model.config) if contract.attention_name is not None else 0
        # the ranks measure their busy times for balanced partitions except under TP, whose peers of one CP rank
        # must cut the same partitions; uneven partitions commit an even share of the K/V except under DCP
        measured, rebalance = tp == 1, dcp is None
        policy = PrefillPolicy(
            world, shape, layers, chain=chain, indexed=indexed, sparse=sparse, measured=measured, rebalance=rebalance
        )
        dcp = Comm(*dcp) if dcp is not None else None
        return PatchedModel(
            rank, world, tp_group, tp, dcp, shape, contract, chain, layers, indexed, sparse, policy, capabilities
        )

    def plan(self, settings, inputs) -> ForwardPlan:
        """This forward's plan, from the contract's checked `Inputs` under the policy of `settings`."""
        return build_plan(
            self.policy.of(settings),
            inputs.cache.layout if inputs.cache is not None else None,
            batch=inputs.batch,
            num_new=inputs.num_new,
            position_ids=inputs.position_ids,
            padding=inputs.padding,
            logits_to_keep=inputs.logits_to_keep,
            uses_cache=inputs.cache is not None,
        )

    def begin(self, plan: ForwardPlan, cache, comm: Comm, position_ids):
        """One forward's (cache, scratch, step): its context made from the plan, handed to the cache it stores into
        (the caller's, or a scratch one) and to the `Step` its attention layers read."""
        context = forward_context(plan, self.rank, comm)
        cache, scratch = self._begin_cache(context, cache, comm, position_ids)
        step = Step(
            plan,
            comm,
            cache,
            self.contract.num_layers,
            kv_shapes=self.kv_shapes,
            dcp=self.dcp,
            sparse=self.sparse,
            indexed=self.indexed,
            family=self.contract.hooks,
            context=context,
        )
        return cache, scratch, step

    def end(self, step, scratch: bool, ok: bool) -> None:
        """The forward's cache once the forward ends, finished or raised (ok False): a chain left unfinished is
        dropped, and the caller's cache commits this forward's layout or forgets its stores (a scratch one is
        dropped as it is)."""
        if step.context.chain is not None:
            step.context.chain.abandon()  # a forward that raised leaves its chain unfinished
        if step.cache is not None and not scratch:
            step.cache.end(ok)

    @property
    def covered_layers(self) -> int:
        """The attention layers the coverage check (attention/coverage.py) expects to have attended through the
        library: every one where the family's attention is switched by name, none where it is patched otherwise."""
        return self.attention_layers if self.contract.attention_name else 0

    def _begin_cache(self, context, cache, comm: Comm, position_ids):
        """The cache this forward stores into, handed the forward's context (with DSA's indexer and the recurrent chain
        where they run): the caller's, or a scratch one (`scratch`) where none was asked for but the states, or the
        index keys every rank's indexer scores, still need one to pass."""
        plan = context.plan
        # (or the copies of its layers a forward adds, which each loop attends through: Dory's)
        stores = plan.storage is not None and bool(self.indexed or self.contract.copies)
        scratch = cache is None and (plan.chained or stores)
        if scratch:
            cache = self.contract.new_cache()
        if cache is None:
            return None, False
        # the cache stores this rank's DCP slots only (every slot without DCP); a cache split otherwise is refused
        cache.layout.set_dcp(*((self.dcp.rank, self.dcp.world) if self.dcp is not None else (0, 1)))
        cache.begin(context)
        if self.indexed:
            context.indexer = Indexer(context, cache, position_ids)
        if plan.chained:
            start_chain(context, cache, comm, receive=self.rank > 0, send=self.rank < self.world - 1)
        return cache, scratch
