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
import time
from collections import Counter

import torch

from .attention import NAME as ATTENTION_NAME
from .attention import current_step
from .attention.coverage import bypass_error, check_attended
from .attention.entries import check as check_entries
from .attention.indexed import check_indexed
from .attention.step import Step
from .cache.states import share_final_states
from .comm.agreement import RankCheck
from .comm.collectives import Comm
from .errors import (
    ContextParallelError,
    PatchStateError,
    UnsupportedInputError,
)
from .inputs import shard_inputs
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
from .plan.context import forward_context
from .plan.forward import ForwardPlan, build_plan
from .plan.policy import PrefillPolicy
from .plan.strategies import STRATEGIES
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
        self._last_prefill = None  # the latest prefill's PrefillDecision: what last_decision reads
        self.algorithm_counts = Counter()  # forwards run per attention algorithm (for tests, benchmarks)
        self.comm = Comm(group, rank, world)  # tagged "attention" (the strategies) and "control" (checks, gathers)
        self.last_forward = None  # algorithm, tokens and attention bytes of the latest forward
        self.last_plan = None
        self.rank, self.world = rank, world
        self.contract = InputContract(model, rank, world, ATTENTION_NAME)
        self.num_layers = self.contract.num_layers
        # recurrent layers (recurrent.py): prefill passes their states down the ranks, decode runs them on every rank
        self.chain = any(r is not None for r in self.contract.recurrence)
        check_layout(model, settings, world, self.shape, self.tp, dcp, self.chain)
        self.attention_layers = attention_layers(model.config)  # for balanced partitions' attention term
        # indexed attention (DSA): every rank's indexer scores every column (attention/indexed.py)
        self.indexed = check_indexed(model.config, settings, dcp is not None)
        check_entries(settings, model.config.model_type, self.contract.recurrence)  # compressed entries (V4's)
        self.sparse = SparseRun.of(settings.sparse, world, full_layers(model.config)) if settings.sparse else None
        # which strategy each prefill runs and how its partitions are cut (plan/policy.py); the ranks measure their
        # busy times for balanced partitions except under TP, whose peers of one CP rank must cut the same ones
        self.policy = PrefillPolicy(
            world,
            self.shape,
            self.attention_layers,
            chain=self.chain,
            indexed=self.indexed,
            sparse=self.sparse,
            measured=self.tp == 1,
            rebalance=self.dcp is None,
        )
        self.approximate = Counter()  # forwards run approximate, by the settings they ran with (CSA's describe())
        self.kv_shapes = {}  # Step.kv_shapes: every attention layer's K/V block geometry, as forwards show it
        self.ranks = RankCheck(self.comm, self.tp_group)
        self._handles = []
        self._rope_modules = []
        self._entered = False  # the pre-hook ran and the module's forward is next (_direct_forward)
        self._forward = None
        self._pending = []  # stack of (step token, step, grad mode, as_tuple, scratch, timing) per running forward

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
            self.policy.of(self.settings),
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
        shard_inputs(kwargs, plan, inputs, self.rank, self.contract.raw_mask)
        context = forward_context(
            plan, self.rank, self.comm, indexed=bool(self.indexed), position_ids=kwargs["position_ids"]
        )
        cache, scratch = self._begin_cache(context, inputs.cache)
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
            cache_window=self.contract.cache_window,
            context=context,
        )
        self._record(plan, inputs)
        token = current_step.set(step)
        # Inference only: the collectives are not differentiable, and autograd would only keep
        # activations alive. The caller's grad mode comes back in the forward hook.
        grad = torch.is_grad_enabled()
        torch.set_grad_enabled(False)
        # balanced partitions learn from measured compute (the policy's MeasuredWork)
        measure = self.policy.measures(self.settings, plan)
        started = (time.perf_counter(), self.comm.stats.wait_s) if measure else None
        self._pending.append((token, step, grad, inputs.as_tuple, scratch, started))
        self._entered = True
        return (), kwargs

    def _begin_cache(self, context, cache):
        """The cache this forward stores into, handed the forward's context: the caller's, or a scratch one (`scratch`)
        where none was asked for but the states, or the index keys every rank's indexer scores, still need one to pass."""
        plan = context.plan
        scratch = cache is None and (plan.chained or (self.indexed and plan.storage is not None))
        if scratch:
            cache = self.contract.new_cache()
        if cache is None:
            return None, False
        # the cache stores this rank's DCP slots only (every slot without DCP); a cache split otherwise is refused
        cache.layout.set_dcp(*((self.dcp.rank, self.dcp.world) if self.dcp is not None else (0, 1)))
        if plan.chained and any(getattr(layer, "record_past", False) for layer in cache.layers):
            raise UnsupportedInputError(  # assisted decoding's: the conv states would then grow per rank
                "assisted and prompt-lookup decoding (a cache recording its past for crop()) are not supported "
                "on models with recurrent layers under context parallelism: decode without them."
            )
        cache.begin(context)
        if plan.chained:
            cache.begin_chain(self.comm, receive=self.rank > 0, send=self.rank < self.world - 1)
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
                step.cache.end_chain()  # the last layer's states to the next rank
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
            if step.cache is not None:
                step.cache.drop_chain()  # a forward that raised leaves its chain unfinished
            self.comm.drop_check()  # a forward that raised drops its check (its collective may be in flight)
            if step.cache is not None and not scratch:  # a scratch cache is dropped as it is
                step.cache.end(ok)
            torch.set_grad_enabled(grad)
        return output

    # -- helpers -----------------------------------------------------------------------
    def _record(self, plan: ForwardPlan, inputs: Inputs):
        """What a forward ran, for `last_forward`, `algorithm_counts` and `approximate` (its bytes come at the end)."""
        self.algorithm_counts[plan.algorithm] += 1
        approximate = self.sparse.csa.describe() if STRATEGIES[plan.algorithm].approximate else None
        if approximate is not None:
            self.approximate[approximate] += 1
        self.last_plan = plan
        if plan.decision is not None:  # a prefill: the plan asked the policy for its strategy
            self._last_prefill = plan.decision
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

    def partitions(self, num_new: int, past: int = 0) -> list[int] | None:
        """The contiguous partition sizes the next prefill of num_new new tokens over `past` would cut (None: the
        policy's default, even); no collective. CSA's answer depends on them (placement decides levels): its
        one-process reference takes this (eval/csa_reference.py)."""
        return self.policy.partitions(self.settings, num_new, past)

    def _measure(self, plan: ForwardPlan, started: tuple):
        """After a measured prefill: every rank's busy seconds (its waits excluded) beside the model's two terms
        for its partition, all-gathered, so every rank's policy fits the same measurements."""
        busy = time.perf_counter() - started[0] - (self.comm.stats.wait_s - started[1])
        mine = self.policy.row(self.settings, plan, self.rank, busy)
        mine = torch.tensor(mine, dtype=torch.float64, device=next(self.model.parameters()).device)
        self.policy.learn(self.comm.all_gather(mine, "control").tolist())

    @property
    def last_decision(self):
        """The planner's Decision for the latest prefill under strategy="auto" (None before one, with a fixed
        strategy, or where only one strategy fits the model: recurrent layers, an indexer, an approximate mode):
        what the plan kept of its policy's decision (`ForwardPlan.decision`)."""
        return self._last_prefill.planner if self._last_prefill is not None else None


@functools.lru_cache(maxsize=64)
def _kept_rows(num: int, keep: int, device) -> torch.Tensor:
    """logits_to_keep=keep as an index into num rows, built once per shape for decode's few tokens (two tensor ops a
    step otherwise); shared read-only, as models only index with it."""
    return torch.arange(num, device=device)[-keep:]
