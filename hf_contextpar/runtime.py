"""What runs around each forward of a patched model: the hooks that read the inputs, plan, execute and gather.

A forward pre-hook on the *ForCausalLM module reads the caller's arguments through the input contract
(model/contract.py: one checked `Inputs` record, or a typed refusal), has this forward's `ForwardPlan` made
(patched.py, from plan/forward.py and the prefill policy of plan/policy.py: a pure function of replicated data,
so every rank builds the same one), checks that every rank got the same inputs (comm/agreement.py), hands each
rank its share of the inputs (inputs.py) and begins the forward's context, cache and `Step` (patched.py), which
the attention layers read. The forward hook finishes the forward: the recurrent chain's last sends, the coverage
check, a measured prefill's timing (the policy), the kept logits and hidden states gathered back into original
order on every rank (outputs.py), and the cache's layout committed. What each forward ran goes to the log
(ledger.py). `generate()` runs unmodified on top; one check after it returns makes sure every rank ends with
the same sequences.
"""

from __future__ import annotations

import functools
from collections import Counter

import torch

from .attention import current_step
from .attention.coverage import bypass_error, check_attended
from .cache.sharded import returned_cache
from .cache.states import share_final_states
from .comm.agreement import RankCheck
from .comm.collectives import Comm
from .errors import ContextParallelError, PatchStateError
from .inputs import shard_inputs
from .ledger import ForwardLog
from .model.candidates import refuse_candidate_decoding
from .model.rope import patch_rope, unpatch_rope
from .outputs import gather_outputs
from .patched import PatchedModel
from .plan.forward import ForwardPlan
from .settings import Settings


class ContextParallelRuntime:
    """Per-model state: the group, the hooks, and what to restore on removal."""

    def __init__(self, model, group, rank, world, settings: Settings):
        self.model, self.settings = model, settings
        self.rank, self.world = rank, world
        self.patched = PatchedModel.of(model, group, rank, world, settings)  # the model's facts, checked
        self.comm = Comm(group, rank, world)  # tagged "attention" (the strategies) and "control" (checks, gathers)
        self.ranks = RankCheck(self.comm, self.patched.tp_group)
        self.log = ForwardLog()  # what the forwards ran: last_forward, algorithm_counts, approximate, last_plan
        self._handles = []
        self._rope_modules = []
        self._entered = False  # the pre-hook ran and the module's forward is next (_direct_forward)
        self._forward = None
        self._pending = []  # per running forward: (step token, step, grad mode, as_tuple, scratch, measure's start)

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
        kwargs, inputs = self.patched.contract.read(args, kwargs)
        plan = self.patched.plan(self.settings, inputs)
        if self.settings.check_inputs:
            self.ranks.inputs(inputs)
        if inputs.as_tuple:  # the gathers read the output's fields: the tuple is made from them afterwards
            kwargs["return_dict"] = True
        shard_inputs(kwargs, plan, inputs, self.rank, self.patched.contract.hooks)
        cache, scratch, step = self.patched.begin(plan, inputs.cache, self.comm, kwargs["position_ids"])
        kwargs[self.patched.contract.cache_arg] = cache
        kwargs["use_cache"] = cache is not None
        self.log.begin(plan, inputs, self.patched.sparse, self.comm.tagged["attention"])
        token = current_step.set(step)
        # Inference only: the collectives are not differentiable, and autograd would only keep
        # activations alive. The caller's grad mode comes back in the forward hook.
        grad = torch.is_grad_enabled()
        torch.set_grad_enabled(False)
        started = self.patched.policy.start(self.settings, plan, self.comm)  # a prefill balanced partitions learn from
        self._pending.append((token, step, grad, inputs.as_tuple, scratch, started))
        self._entered = True
        return (), kwargs

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
                check_attended(self.model, step, self.patched.covered_layers)
            if ok and started is not None:
                self.patched.policy.measure(
                    self.settings, plan, started, self.comm, next(self.model.parameters()).device
                )
            if ok and scratch:
                if returned_cache(output) is not None:  # what the caller gets without use_cache
                    output[self.patched.contract.cache_arg] = None
            elif ok and plan.chained:  # decode runs every recurrent layer on every rank, from the last states
                share_final_states(step.cache, self.comm, root=self.world - 1)
            if ok and step.cache is not None and not scratch:  # the states a family returns outside its cache
                self.patched.contract.hooks.finish(output, step.cache)
            if ok:
                self.comm.run_check()  # a forward with no attention collective (none ran) still checks
            self.log.end(self.comm.tagged["attention"])
            if ok:
                output = gather_outputs(
                    output, plan.outputs, self.comm, type(self.model).__name__, self.patched.contract.streams
                )
            if as_tuple and ok:
                output = output.to_tuple()
        except BaseException:
            ok = False
            raise
        finally:
            self.comm.drop_check()  # a forward that raised drops its check (its collective may be in flight)
            self.patched.end(step, scratch, ok)
            torch.set_grad_enabled(grad)
        return output

    # -- what the forwards ran, and what the next prefill would cut ---------------------------
    @property
    def last_forward(self) -> dict | None:
        return self.log.last_forward

    @property
    def last_plan(self) -> ForwardPlan | None:
        return self.log.last_plan

    @property
    def algorithm_counts(self) -> Counter:
        return self.log.algorithm_counts

    @property
    def approximate(self) -> Counter:
        return self.log.approximate

    def partitions(self, num_new: int, past: int = 0) -> list[int] | None:
        """The contiguous partition sizes the next prefill of num_new new tokens over `past` would cut (None: the
        policy's default, even); no collective. CSA's answer depends on them (placement decides levels): its
        one-process reference takes this (eval/csa_reference.py)."""
        return self.patched.policy.partitions(self.settings, num_new, past)

    @property
    def last_decision(self):
        """The planner's Decision for the latest prefill under strategy="auto" (None before one, with a fixed
        strategy, or where only one strategy fits the model: recurrent layers, an indexer, an approximate mode):
        what the plan kept of its policy's decision (`ForwardPlan.decision`)."""
        return self.log.last_prefill.planner if self.log.last_prefill is not None else None
