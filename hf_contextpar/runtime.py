"""What runs around each forward of a patched model: read the inputs, plan, execute, gather.

A forward pre-hook on the *ForCausalLM module reads the caller's arguments through the input
contract (model/contract.py: one checked `Inputs` record, or a typed refusal), builds this forward's
`ForwardPlan` (plan/forward.py: a pure function of replicated data, so every rank builds the same one),
checks that every rank got the same inputs (comm/agreement.py), tells the cache, and hands each rank
its share of the inputs. Attention layers read the running `Step` (the plan plus this rank's
communicator and per-layer state). The forward hook gathers the kept logits and hidden states
back into original order on every rank (outputs.py) and commits the cache's layout.
`generate()` runs unmodified on top; one check after it returns makes sure every rank ends with
the same sequences.
"""

from __future__ import annotations

import functools
import math
import time
from collections import Counter

import torch

from .attention import NAME as ATTENTION_NAME
from .attention import current_step
from .attention.coverage import bypass_error, check_attended
from .attention.entries import check as check_entries
from .attention.indexed import Indexer
from .attention.step import Step
from .cache.recurrent import start_chain
from .cache.states import share_final_states
from .capabilities import Facts
from .capabilities import check as check_capabilities
from .comm.agreement import RankCheck
from .comm.collectives import Comm
from .errors import (
    ContextParallelError,
    PatchStateError,
)
from .mesh import check_cp_group, dcp_of, tensor_parallel
from .model.contract import (
    InputContract,
    Inputs,
    attention_layers,
)
from .model.limits import check_layout, refuse_candidate_decoding
from .model.rope import patch_rope, unpatch_rope
from .model.shape import model_shape
from .outputs import gather_outputs
from .plan.choice import choose
from .plan.context import forward_context
from .plan.forward import ForwardPlan, Policy, build_plan
from .plan.partitions import MeasuredWork, balanced, key_pairs, weighted
from .settings import Settings
from .sparse.csa import SparseRun, full_layers


class ContextParallelRuntime:
    """Per-model state: the group, the hooks, and what to restore on removal."""

    def __init__(self, model, group, rank, world, settings: Settings):
        self.model, self.settings = model, settings
        # transformers' tensor parallelism (mesh.py): its group joins every rank agreement, and each
        # rank attends with the heads it holds
        self.tp_group, self.tp = tensor_parallel(model)
        check_cp_group(group, self.tp_group)
        self.shape = model_shape(model)
        dcp = dcp_of(model)  # DCP: (group, index, size) of the TP ranks sharing this rank's KV head
        self.dcp = Comm(*dcp) if dcp is not None else None
        self._last_prefill = None  # (T, P) of the latest prefill: what last_decision re-derives
        self.algorithm_counts = Counter()  # forwards run per attention algorithm (for tests, benchmarks)
        self.comm = Comm(group, rank, world)  # tagged "attention" (the strategies) and "control" (checks, gathers)
        self.last_forward = None  # algorithm, tokens and attention bytes of the latest forward
        self.last_plan = None
        self.rank, self.world = rank, world
        self.contract = InputContract(model, rank, world, ATTENTION_NAME)
        self.num_layers = self.contract.num_layers
        recurrent = any(r is not None for r in self.contract.recurrence)
        # each capability's refusals, in its own room (capabilities.py): whole heads, indexed attention (DSA: every
        # rank's indexer scores every column), the recurrent chain (prefill passes states down the ranks)
        self.capabilities = check_capabilities(Facts(model, settings, world, self.tp, dcp, self.shape, recurrent))
        self.chain, self.indexed = self.capabilities["chain"], self.capabilities["indexed"]
        check_layout(settings, dcp)
        self.work = MeasuredWork()  # balanced partitions' two terms as measured (`balanced`)
        self.attention_layers = attention_layers(model.config)  # for balanced partitions' attention term
        check_entries(settings, model.config.model_type, self.contract.recurrence)  # compressed entries (V4's)
        self.sparse = SparseRun.of(settings.sparse, world, full_layers(model.config)) if settings.sparse else None
        self.approximate = Counter()  # forwards run approximate, by the settings they ran with (CSA's describe())
        self.kv_shapes = {}  # Step.kv_shapes: every attention layer's K/V block geometry, as forwards show it
        self.ranks = RankCheck(self.comm, self.tp_group)
        self._handles = []
        self._rope_modules = []
        self._entered = False  # the pre-hook ran and the module's forward is next (_direct_forward)
        self._forward = None
        self._policy_of, self._policy_cached = None, None  # the settings _policy's Policy was built for, and it
        self._pending = []  # stack of (step token, step, grad mode, as_tuple, scratch, timing) per running forward

    @property
    def balanced(self) -> bool:
        """KV-Runahead's and a chain's partitions by default ("balanced" or None): of equal work
        (partitions.balanced), measured as prefills run (MeasuredWork), because causal attention gives the
        last of even partitions the most work and the others wait for it in the output gather. "even"
        (KVR-E) and a table (KVR-P) only when asked. Read from the settings at each forward, so the
        search's tables (`kvr_prefill_seconds`, which swaps them in) win."""
        return self.settings.partitions in (None, "balanced")

    def __deepcopy__(self, memo):  # reached through the model's hooks and attributes
        raise PatchStateError(
            "a model patched by apply_context_parallel cannot be deep-copied (its runtime holds the process "
            "group): copy it before applying, or remove_context_parallel(model), copy, and apply to each."
        )

    # -- install / uninstall -------------------------------------------------------------
    def install(self):
        m = self.model
        self._handles = [
            m.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
            m.register_forward_hook(self._post_forward, with_kwargs=True, always_call=True),
        ]
        self._rope_modules = patch_rope(m)
        m.generate = self._generate
        self._forward = m.__dict__.get("forward")  # an instance forward installed before (accelerate's hooks)
        m.forward = self._direct_forward(m.forward)

    def uninstall(self):
        for h in self._handles:
            h.remove()
        self._handles = []
        unpatch_rope(self._rope_modules)
        self._rope_modules = []
        self.model.__dict__.pop("generate", None)
        if self._forward is not None:
            self.model.forward = self._forward
        else:
            self.model.__dict__.pop("forward", None)

    def _direct_forward(self, forward):
        """model.forward(...) as model(...) (PEFT's LoRA calls its base model's forward): a call that did not come
        through the module's hooks goes through them; the hooked call itself runs the model's forward."""

        @functools.wraps(forward)
        def direct(*args, **kwargs):
            if not self._entered:
                return self.model(*args, **kwargs)
            self._entered = False  # the pre-hook just ran: this is the module call's own forward
            try:
                return forward(*args, **kwargs)
            except ContextParallelError:
                raise
            except Exception as e:  # a layer that bypassed the library's attention failed on this rank's shard
                step = current_step.get()
                bypass = bypass_error(e.__traceback__, step.attended if step is not None else ())
                if bypass is None:
                    raise
                raise bypass from e

        return direct

    def _generate(self, *args, **kwargs):
        """model.generate, after refusing what one process does not run exactly, then (check_inputs)
        one check that every rank returns the same sequences."""
        refuse_candidate_decoding(self.model, args, kwargs)
        out = type(self.model).generate(self.model, *args, **kwargs)
        if self.settings.check_inputs:
            self.ranks.outputs(out if isinstance(out, torch.Tensor) else out.sequences)
        return out

    # -- hooks -------------------------------------------------------------------------
    def _pre_forward(self, module, args, kwargs):
        kwargs, inputs = self.contract.read(args, kwargs)
        plan = build_plan(
            self._policy(),
            inputs.cache.layout if inputs.cache is not None else None,
            batch=inputs.batch,
            num_new=inputs.num_new,
            position_ids=inputs.position_ids,
            padding=inputs.padding,
            logits_to_keep=inputs.logits_to_keep,
            uses_cache=inputs.cache is not None,
        )
        if self.settings.check_inputs:
            self.ranks.inputs(inputs)
        if inputs.as_tuple:  # the gathers read the output's fields: the tuple is made from them afterwards
            kwargs["return_dict"] = True
        self._shard_inputs(kwargs, plan, inputs)
        context = forward_context(plan, self.rank, self.comm)
        cache, scratch = self._begin_cache(context, inputs.cache, kwargs["position_ids"])
        kwargs[self.contract.cache_arg] = cache
        kwargs["use_cache"] = cache is not None
        step = Step(
            plan,
            self.comm,
            cache,
            self.num_layers,
            kv_shapes=self.kv_shapes,
            dcp=self.dcp,
            sparse=self.sparse,
            indexed=self.indexed,
            family=self.contract.hooks,
            context=context,
        )
        self._record(plan, inputs)
        token = current_step.set(step)
        # Inference only: the collectives are not differentiable, and autograd would only keep
        # activations alive. The caller's grad mode comes back in the forward hook.
        grad = torch.is_grad_enabled()
        torch.set_grad_enabled(False)
        # balanced partitions learn from measured compute (MeasuredWork); not under TP, whose peers of one CP rank
        # must cut the same partitions and would each measure their own times, nor under CSA (model terms only)
        measure = self.balanced and plan.sized and self.tp == 1 and plan.algorithm != "csa"
        started = (time.perf_counter(), self.comm.stats.wait_s) if measure else None
        self._pending.append((token, step, grad, inputs.as_tuple, scratch, started))
        self._entered = True
        return (), kwargs

    def _begin_cache(self, context, cache, position_ids):
        """The cache this forward stores into, handed the forward's context (with DSA's indexer and the recurrent chain
        where they run): the caller's, or a scratch one (`scratch`) where none was asked for but the states, or the
        index keys every rank's indexer scores, still need one to pass."""
        plan = context.plan
        scratch = cache is None and (plan.chained or (self.indexed and plan.storage is not None))
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
            start_chain(context, cache, self.comm, receive=self.rank > 0, send=self.rank < self.world - 1)
        return cache, scratch

    def _post_forward(self, module, args, kwargs, output):
        self._entered = False
        if not self._pending:
            return output
        token, step, grad, as_tuple, scratch, started = self._pending.pop()
        current_step.reset(token)
        plan, ok = step.plan, output is not None  # output None: the forward raised already
        try:
            if ok and plan.chained:
                step.context.chain.end()  # the last layer's states to the next rank
            if ok:  # after the chain's sends complete (the next rank receives them in this forward), before any output
                check_attended(self.model, step, self.attention_layers if self.contract.attention_name else 0)
            if ok and started is not None:
                self._measure(plan, started)
            if ok and scratch:
                output[self.contract.cache_arg] = None  # what the caller gets without use_cache
            elif ok and plan.chained:  # decode runs every recurrent layer on every rank, from the last states
                share_final_states(step.cache, self.comm, root=self.world - 1)
            if ok:
                self.comm.settle()  # a forward with no attention collective (none ran) still checks
            self.last_forward["bytes_sent"] += self._attention.bytes_sent
            self.last_forward["bytes_received"] += self._attention.bytes_received
            if ok:
                output = gather_outputs(
                    output, plan.outputs, self.comm, type(self.model).__name__, self.contract.streams
                )
            if as_tuple and ok:
                output = output.to_tuple()
        except BaseException:
            ok = False
            raise
        finally:
            if step.context.chain is not None:
                step.context.chain.abandon()  # a forward that raised leaves its chain unfinished
            self.comm.drop_check()  # a forward that raised drops its check (its collective may be in flight)
            if step.cache is not None and not scratch:  # a scratch cache is dropped as it is
                step.cache.end(ok)
            torch.set_grad_enabled(grad)
        return output

    # -- helpers -----------------------------------------------------------------------
    def _record(self, plan: ForwardPlan, inputs: Inputs):
        """What a forward ran, for `last_forward`, `algorithm_counts` and `approximate` (its bytes come at the end)."""
        self.algorithm_counts[plan.algorithm] += 1
        approximate = self.sparse.csa.describe() if plan.algorithm == "csa" else None
        if approximate is not None:
            self.approximate[approximate] += 1
        self.last_plan = plan
        if plan.shards.token_rows is not None:  # a prefill: the plan asked the policy for its strategy
            self._last_prefill = (plan.num_new, plan.past)
        self.last_forward = dict(
            algorithm=plan.algorithm,
            tokens=inputs.num_new,
            past=inputs.past,
            bytes_sent=-self._attention.bytes_sent,
            bytes_received=-self._attention.bytes_received,
            approximate=approximate,  # None: the exact result
        )

    @property
    def _attention(self):
        return self.comm.tagged["attention"]

    def _policy(self) -> Policy:  # built once per settings value (calibrate swaps them whole), not per forward
        if self._policy_of is not self.settings:
            self._policy_cached, self._policy_of = self._new_policy(), self.settings
        return self._policy_cached

    def _new_policy(self) -> Policy:
        table, s = self.settings.partition_table, self.settings
        sizes = (lambda t, p: table.sizes(t, self.world)) if table is not None else None
        sizes = self._balanced if self.balanced else sizes
        decode = "replicated" if self.indexed else s.decode  # batched pass-Q decode moves queries (refused at apply)
        return Policy(
            self.world, decode, self._choose, sizes, s.kv_interleave, chain=self.chain, rebalance=self.dcp is None
        )

    def _balanced(self, num_new: int, past: int) -> list[int]:
        """Contiguous partitions of equal work: a token's, plus a term per key its queries see, as measured. Under
        CSA a query sees only the kept keys of an earlier partition at the pruning layers (`pair_weights`), and the
        terms are the cost model's, never the measured scales: CSA's answer depends on its partitions, so the same
        prompt must cut the same way in every run (and in its one-process reference)."""
        per_token, per_pair = self._work_terms()
        if self._sparse(past):
            weights = self.sparse.pair_weights(self.world, self.attention_layers)
            return weighted(num_new, self.world, per_token, per_pair, weights)
        a, b = self.work.scales()
        return balanced(num_new, self.world, past, a * per_token, b * per_pair)

    def partitions(self, num_new: int, past: int = 0) -> list[int] | None:
        """The contiguous partition sizes the next prefill of num_new new tokens over `past` would cut (None: the
        policy's default, even); no collective. CSA's answer depends on them (placement decides levels): its
        one-process reference takes this (eval/csa_reference.py)."""
        sizes = self._policy().kvr_sizes
        return sizes(num_new, past) if sizes is not None else None

    def _work_terms(self) -> tuple[float, float]:
        """The cost model's seconds per token (its linear layers) and per key a query sees, at the agreed
        calibration's rates."""
        s, cal = self.shape, self.settings.calibration
        gemm = cal.gemm_flops if math.isfinite(cal.gemm_flops) else cal.attn_flops  # uncalibrated: one rate
        return 2 * s.layers * s.linear_weights / gemm, 4 * s.heads * s.head_dim * self.attention_layers / cal.attn_flops

    def _measure(self, plan: ForwardPlan, started: tuple):
        """After a balanced prefill: every rank's busy seconds (its waits excluded) beside the model's two terms
        for its partition, all-gathered, so every rank fits the same `MeasuredWork`."""
        rows = plan.shards.token_rows[self.rank]
        start, end = int(rows[0]), int(rows[-1]) + 1
        busy = time.perf_counter() - started[0] - (self.comm.stats.wait_s - started[1])
        per_token, per_pair = self._work_terms()
        mine = [per_token * (end - start), per_pair * key_pairs(start, end, plan.past), busy]
        mine = torch.tensor(mine, dtype=torch.float64, device=next(self.model.parameters()).device)
        self.work.add(self.comm.all_gather(mine, "control").tolist())

    def _sparse(self, past: int) -> bool:
        return self.sparse is not None and past == 0  # asked for: a fresh prefill runs approximate (CSA)

    def _choose(self, num_new: int, past: int) -> str:
        if self._sparse(past):
            return "csa"
        if self.settings.strategy != "auto":
            return self.settings.strategy
        if self.chain:  # one way down the ranks, as the states go (plan/forward.py: ring pass-KV over a cache)
            return "kv_runahead"
        if self.indexed:  # of pass-KV and pass-Q, the one that keeps each query (and its top-k) on its rank
            return "ring_pass_kv"
        s = self.settings
        return choose(num_new, past, self.world, self.shape, s.calibration, s.planner_rule).strategy

    @property
    def last_decision(self):
        """The planner's Decision for the latest prefill under strategy="auto" (None before one, with a fixed
        strategy, or on a model with recurrent layers): the pure choice the plan made, derived again here, so
        the plan never writes back into the runtime."""
        s = self.settings
        if self._last_prefill is None or s.strategy != "auto" or self.chain or self.indexed:
            return None
        if self.sparse is not None and self._last_prefill[1] == 0:  # it ran CSA, asked for
            return None
        return choose(*self._last_prefill, self.world, self.shape, s.calibration, s.planner_rule)

    def _shard_inputs(self, kwargs, plan: ForwardPlan, inputs: Inputs):
        """This rank's share of the inputs: its new tokens (sequence sharding) or its sequences (batched decode)."""
        kwargs["position_ids"] = inputs.position_ids
        shards = plan.shards
        if shards.token_rows is not None:
            mine = shards.token_rows[self.rank]
            if plan.chained and inputs.mask is not None:
                # the family's cut of the mask (FamilyHooks.chained_mask), its tokens' columns ending at `end`
                end = inputs.mask.shape[1] - plan.num_new + int(mine[-1]) + 1
                kwargs["attention_mask"] = self.contract.hooks.chained_mask(inputs.mask, end - len(mine), end)
            for name in ("input_ids", "inputs_embeds", "position_ids"):
                if kwargs.get(name) is not None:
                    kwargs[name] = kwargs[name][:, mine.to(kwargs[name].device)]
            if kwargs.get("cache_position") is not None:  # remote-code models still take it
                kwargs["cache_position"] = kwargs["cache_position"][mine.to(kwargs["cache_position"].device)]
            kwargs["logits_to_keep"] = plan.outputs.keep[self.rank]
        elif shards.seq_rows is not None:
            mine = shards.seq_rows[self.rank]
            for name in ("input_ids", "inputs_embeds", "position_ids"):
                if kwargs.get(name) is not None:
                    kwargs[name] = kwargs[name][mine]
        keep = kwargs.get("logits_to_keep", 0)
        if isinstance(keep, int):  # the rows an int means, as an index: a model may act on an int itself (Gemma 4
            # drops the other rows before its KV-shared layers, by each rank's own token count)
            x = next(kwargs[k] for k in ("input_ids", "inputs_embeds") if kwargs.get(k) is not None)
            n = x.shape[1]
            kwargs["logits_to_keep"] = (
                _kept_rows(n, keep, x.device) if n <= 8 else torch.arange(n, device=x.device)[-keep:]
            )


@functools.lru_cache(maxsize=64)
def _kept_rows(num: int, keep: int, device) -> torch.Tensor:
    """logits_to_keep=keep as an index into num rows, built once per shape for decode's few tokens (two tensor ops a
    step otherwise); shared read-only, as models only index with it."""
    return torch.arange(num, device=device)[-keep:]
