"""What runs around each forward of a patched model: build the plan, execute it, gather outputs.

A forward pre-hook on the *ForCausalLM module validates the caller's inputs, builds this
forward's `ForwardPlan` (plan.py: a pure function of replicated data, so every rank builds the
same one), tells the cache, and hands each rank its share of the inputs. Attention layers read
the running `Step` (the plan plus this rank's communicator and per-layer state). The forward
hook gathers the kept logits and hidden states back into original order on every rank and
commits the cache's layout. `generate()` runs unmodified on top; one check after it returns
makes sure every rank ends with the same sequences.
"""

from __future__ import annotations

import inspect
import types
from collections import Counter

import torch
from transformers.cache_utils import Cache, DynamicCache

from .attention import NAME as ATTENTION_NAME
from .attention import current_step
from .cache import ShardedCache, cache_argument, cache_windows
from .comm import Comm
from .costmodel import Shape
from .errors import ContextParallelError, UnsupportedModelError
from .partitions import PartitionTable
from .plan import ForwardPlan, Gather, Policy, build_plan
from .planner import Calibration, choose
from .step import Step


def _fingerprint(t: torch.Tensor | None) -> int:
    """Cheap order-sensitive hash of a tensor's contents (0 for None)."""
    if t is None:
        return 0
    if t.is_floating_point():
        return int(t.double().sum().view(torch.int64)) ^ int((t.double().flatten()[::97] * 3.1).sum().view(torch.int64))
    return _int_fingerprint([t])


def _int_fingerprint(tensors) -> int:
    """One order-sensitive hash of integer tensors' contents, read as one vector: five ops whatever
    their number (the input check runs before every decode step). Callers fix the boundaries (the
    shapes go into the check beside it)."""
    flat = torch.cat([t.reshape(-1).long() for t in tensors])
    w = torch.arange(1, flat.numel() + 1, device=flat.device) * 1000003 + 7919
    return int((flat * w).sum())


CHECK_LENGTH = 8


def _check_vector(values: list) -> torch.Tensor:
    """A rank-agreement check's message: always CHECK_LENGTH integers, so ranks that reach different
    checks (one decoding, one done) exchange equal sizes and see a mismatch. Gloo aborts the process
    on unequal all-gather sizes instead of raising."""
    return torch.tensor(values + [0] * (CHECK_LENGTH - len(values)), dtype=torch.long)


def _is_packed(position_ids: torch.Tensor) -> bool:
    """transformers' rule (masking_utils.find_packed_sequence_indices): a row whose positions do not
    go up by exactly one holds several packed documents."""
    first = position_ids[:, :1] - 1
    return bool((torch.diff(position_ids, prepend=first, dim=-1) != 1).any())


def _checked_positions(position_ids, mask, cache, batch: int, num_new: int, past: int, device):
    """The forward's global position ids (B, T), after refusing inputs whose mask the plan cannot
    reproduce: a 4D or wrongly sized mask, and packed documents."""
    if mask is not None and mask.dim() != 2:
        raise ContextParallelError(
            "hf-contextpar needs the 2D padding mask (batch, past + new tokens); got a "
            f"{mask.dim()}D attention_mask. Pass the tokenizer's attention_mask instead of a prepared mask."
        )
    if past and cache.layout.batch != batch:  # one process fails deep in torch (a cat or a broadcast)
        raise ContextParallelError(
            f"the cache holds {cache.layout.batch} sequences but the input has {batch}; pass a cache made "
            "for this batch (or none), or reorder it with the cache's batch methods first."
        )
    if mask is not None and mask.shape[1] != past + num_new:
        again = (
            " (the input repeats the cached tokens: transformers' assisted and prompt-lookup decoding do "
            "that over a cache filled by an earlier call; start them with no cache)"
            if mask.shape[1] == num_new
            else ""
        )
        raise ContextParallelError(
            f"attention_mask covers {mask.shape[1]} tokens but the cache holds {past} and the input adds "
            f"{num_new}; pass the mask for the whole sequence (past + new), as generate() does{again}."
        )
    if position_ids is None:
        return (torch.arange(num_new, device=device) + past).unsqueeze(0).expand(batch, -1)
    if mask is None and cache is None and _is_packed(position_ids):
        raise ContextParallelError(
            "these position_ids restart inside a row, which transformers reads as packed documents "
            "(a block-diagonal mask); hf-contextpar does not shard packed sequences. Run each document "
            "as its own row (with padding and an attention_mask), or pass an all-ones attention_mask if "
            "the jumps in position_ids are not document boundaries."
        )
    return position_ids.expand(batch, -1)


class ContextParallelRuntime:
    """Per-model state: the group, the hooks, and what to restore on removal."""

    def __init__(
        self,
        model,
        group,
        rank,
        world,
        strategy: str = "auto",
        check_inputs: bool = True,
        calibration=None,
        planner_rule: str = "cost",
        decode: str = "auto",
        kvr_partitions=None,
        kv_interleave: int = 1,
    ):
        self.model = model
        self.strategy, self.planner_rule, self.decode = strategy, planner_rule, decode
        self.kv_interleave = kv_interleave
        self.partitions = PartitionTable.load(kvr_partitions) if kvr_partitions is not None else None
        device = next(model.parameters()).device
        self.calibration = Calibration.resolve(calibration, device.type)
        self.shape = Shape.from_model(model)
        self.last_decision = None  # the planner's Decision for the latest prefill (strategy="auto")
        self.algorithm_counts = Counter()  # forwards run per attention algorithm (for tests, benchmarks)
        self.comm = Comm(group, rank, world)  # tagged "attention" (the strategies) and "control" (checks, gathers)
        self.last_forward = None  # algorithm, tokens and attention bytes of the latest forward
        self.last_plan = None
        self.rank, self.world = rank, world
        self.check_inputs = check_inputs
        self.num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
        # the sliding layers of the cache the unpatched model makes when given none
        self.windows = cache_windows(DynamicCache(config=model.config))
        self._params = list(inspect.signature(model.forward).parameters)
        # the forward's cache argument, and the names a caller may pass it under (5.24 keeps the old one)
        self._cache_arg = cache_argument(model)
        self._cache_names = ("cache", "past_key_values") if self._cache_arg == "cache" else ("past_key_values",)
        self._handles = []
        self._rope_modules = []
        self._pending = []  # stack of (step token, step, grad mode) per running forward

    def __deepcopy__(self, memo):  # reached through the model's hooks and attributes
        raise ContextParallelError(
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
        self._rope_modules = [mod for mod in m.modules() if _position_dependent_rope(mod)]
        for mod in self._rope_modules:
            mod.forward = types.MethodType(_global_rope_forward, mod)
        if self.check_inputs:
            m.generate = types.MethodType(_checked_generate, m)

    def uninstall(self):
        for h in self._handles:
            h.remove()
        self._handles = []
        for mod in self._rope_modules:
            del mod.forward
        self._rope_modules = []
        self.model.__dict__.pop("generate", None)

    # -- hooks -------------------------------------------------------------------------
    def _pre_forward(self, module, args, kwargs):
        kwargs = dict(kwargs)
        for name, value in zip(self._params, args):
            kwargs[name] = value
        self._reject_unsupported(kwargs)
        if self.model.config._attn_implementation != ATTENTION_NAME:  # else each rank attends to its shard alone
            raise ContextParallelError(
                f"the model's attention implementation is {self.model.config._attn_implementation!r}, changed after "
                "apply_context_parallel; call remove_context_parallel(model), set the implementation, then apply "
                "again."
            )
        ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
        x = embeds if embeds is not None else ids
        if x is None:
            raise ContextParallelError("pass input_ids or inputs_embeds to the patched model.")
        batch, num_new = x.shape[0], x.shape[1]
        if num_new == 0:  # one process fails inside the model too
            raise ContextParallelError("the input holds no tokens (sequence length 0); pass at least one.")

        cache = self._resolve_cache(self._take_cache(kwargs), kwargs.get("use_cache"))
        past = cache.layout.seq_length if cache is not None else 0
        mask = kwargs.get("attention_mask")
        position_ids = _checked_positions(kwargs.get("position_ids"), mask, cache, batch, num_new, past, x.device)
        padding = None if mask is None or bool(mask.all()) else mask.bool()

        plan = build_plan(
            self._policy(),
            cache.layout if cache is not None else None,
            batch=batch,
            num_new=num_new,
            position_ids=position_ids,
            padding=padding,
            logits_to_keep=kwargs.get("logits_to_keep", 0),
            uses_cache=cache is not None,
        )
        # the gathers below read the output's fields: a tuple is made from them afterwards
        as_tuple = not (
            kwargs["return_dict"]
            if kwargs.get("return_dict") is not None
            else getattr(self.model.config, "return_dict", True)
        )
        if self.check_inputs:
            # what, besides the inputs, sets the gathers after the forward (sizes, and whether they run)
            keep = kwargs.get("logits_to_keep", 0)
            keep = keep.flatten().tolist() if isinstance(keep, torch.Tensor) else [keep]
            hidden = kwargs.get("output_hidden_states")
            outputs = [as_tuple, hidden is None, bool(hidden), *keep]
            self._check_inputs(batch, num_new, past, ids, embeds, mask, position_ids, cache, outputs)
        if as_tuple:
            kwargs["return_dict"] = True

        self._shard_inputs(kwargs, plan, position_ids)
        if cache is not None:
            cache.begin(plan)
        kwargs[self._cache_arg] = cache
        kwargs["use_cache"] = cache is not None
        step = Step(plan, self.comm, cache, self.num_layers)
        self.algorithm_counts[plan.algorithm] += 1
        self.last_plan = plan
        self.last_forward = dict(
            algorithm=plan.algorithm,
            tokens=num_new,
            past=past,
            bytes_sent=-self._attention.bytes_sent,
            bytes_received=-self._attention.bytes_received,
        )
        token = current_step.set(step)
        # Inference only: the collectives are not differentiable, and autograd would only keep
        # activations alive. The caller's grad mode comes back in the forward hook.
        grad = torch.is_grad_enabled()
        torch.set_grad_enabled(False)
        self._pending.append((token, step, grad, as_tuple))
        return (), kwargs

    def _post_forward(self, module, args, kwargs, output):
        if not self._pending:
            return output
        token, step, grad, as_tuple = self._pending.pop()
        current_step.reset(token)
        plan, ok = step.plan, output is not None  # output None: the forward raised already
        try:
            if ok:
                self.comm.settle()  # a forward with no attention collective (none ran) still checks
            self.last_forward["bytes_sent"] += self._attention.bytes_sent
            self.last_forward["bytes_received"] += self._attention.bytes_received
            if plan.gather is not None and ok:
                if isinstance(output, tuple):
                    raise ContextParallelError(
                        f"{type(self.model).__name__} returned a tuple although asked for return_dict=True; "
                        "hf-contextpar gathers every rank's logits from the model's output object, so a model "
                        "that always returns tuples is not supported."
                    )
                if getattr(output, "logits", None) is not None:
                    output.logits = self._gather_rows(output.logits, plan.gather)
                if getattr(output, "hidden_states", None) is not None:
                    output.hidden_states = tuple(self._gather_rows(h, plan.hidden) for h in output.hidden_states)
            if as_tuple and ok:
                output = output.to_tuple()
        except BaseException:
            ok = False
            raise
        finally:
            self.comm.drop_check()  # a forward that raised drops its check (its collective may be in flight)
            if step.cache is not None:
                step.cache.end(plan, ok)
            torch.set_grad_enabled(grad)
        return output

    # -- helpers -----------------------------------------------------------------------
    @property
    def _attention(self):
        return self.comm.tagged["attention"]

    def _policy(self) -> Policy:
        sizes = (lambda t: self.partitions.sizes(t, self.world)) if self.partitions is not None else None
        return Policy(self.world, self.decode, self._choose, sizes, self.kv_interleave)

    def _choose(self, num_new: int, past: int) -> str:
        if self.strategy != "auto":
            return self.strategy
        self.last_decision = choose(num_new, past, self.world, self.shape, self.calibration, self.planner_rule)
        return self.last_decision.strategy

    def _shard_inputs(self, kwargs, plan: ForwardPlan, position_ids):
        """This rank's share of the inputs: its new tokens (sequence sharding) or its sequences (batched decode)."""
        kwargs["position_ids"] = position_ids
        if plan.token_rows is not None:
            mine = plan.token_rows[self.rank]
            for name in ("input_ids", "inputs_embeds", "position_ids"):
                if kwargs.get(name) is not None:
                    kwargs[name] = kwargs[name][:, mine.to(kwargs[name].device)]
            if kwargs.get("cache_position") is not None:  # remote-code models still take it
                kwargs["cache_position"] = kwargs["cache_position"][mine.to(kwargs["cache_position"].device)]
            kwargs["logits_to_keep"] = plan.keep[self.rank]
        elif plan.seq_rows is not None:
            mine = plan.seq_rows[self.rank]
            for name in ("input_ids", "inputs_embeds", "position_ids"):
                if kwargs.get(name) is not None:
                    kwargs[name] = kwargs[name][mine]

    def _reject_unsupported(self, kwargs):
        if kwargs.get("labels") is not None:
            raise ContextParallelError(
                "labels are not supported under context parallelism: compute the loss from the gathered "
                "logits (model(..., logits_to_keep=0).logits), which are identical on every rank."
            )
        if kwargs.get("output_attentions"):
            raise ContextParallelError("output_attentions=True is not supported under context parallelism.")

    def _take_cache(self, kwargs):
        """The caller's cache (removed from kwargs). Given under both names, transformers 5.24 takes
        `cache` and ignores `past_key_values` (with a warning): so does this."""
        present = [name for name in self._cache_names if name in kwargs]
        cache = kwargs[present[0]] if present else None
        for name in present:
            del kwargs[name]
        return cache

    def _resolve_cache(self, cache, use_cache):
        if use_cache is None:
            use_cache = getattr(self.model.config.get_text_config(decoder=True), "use_cache", True)
        if isinstance(cache, ShardedCache):
            if cache.layout.world != self.world or cache.layout.rank != self.rank:
                raise ContextParallelError("this ShardedCache belongs to a different context-parallel group.")
            return cache
        if cache is None:
            return ShardedCache(self.num_layers, self.rank, self.world, self.windows) if use_cache else None
        if type(cache) is DynamicCache and cache.get_seq_length() == 0:
            if getattr(cache, "offloading", False):
                raise ContextParallelError(
                    "an offloaded cache (cache_implementation='offloaded') is not supported under context "
                    "parallelism: each rank keeps its 1/N of the KV cache in a ShardedCache on its device. "
                    "Drop cache_implementation."
                )
            # generate()'s fresh default cache, or an empty one the caller keeps and passes again:
            # the object itself becomes the sharded cache, so the caller's reference carries the state
            return ShardedCache.bind(cache, self.num_layers, self.rank, self.world)
        if isinstance(cache, Cache):
            raise ContextParallelError(
                f"a {type(cache).__name__} cannot be used under context parallelism: each rank keeps its own "
                "ShardedCache. Pass no cache or an empty DynamicCache() (generate()'s default) and pass back "
                "the cache the patched model returned (output.cache; output.past_key_values before transformers "
                "5.24); static, sliding-window (static), quantized and "
                "offloaded caches (cache_implementation other than 'dynamic') are not supported, nor a cache "
                "filled without context parallelism."
            )
        raise ContextParallelError(f"unsupported cache (past_key_values) of type {type(cache).__name__}.")

    def _check_inputs(self, batch, num_new, past, ids, embeds, mask, position_ids, cache, outputs):
        """Every rank's input fingerprint, compared before the forward's first message (see
        Comm.check_before_next: over shared memory it costs no collective of its own). So does what,
        besides its length, sets the cache's message sizes (`ShardedCache.sizing`), and `outputs`,
        the integers that set the output gathers (return_dict, hidden states, logits_to_keep)."""
        sizing = (cache.sizing() if cache is not None else []) + outputs
        # the integer inputs hashed as one vector; their sizes follow from the header (the mask's is
        # past + num_new, checked before, position_ids are (batch, num_new)), what is present from the
        # flags. Every rank's fingerprint must have the same length: it is all-gathered.
        ints = [t.to(position_ids.device) for t in (ids, mask) if t is not None]
        fp = _check_vector(
            [
                batch,
                num_new,
                past,
                ids is not None,
                mask is not None,
                len(sizing),
                _int_fingerprint([*ints, position_ids, torch.tensor(sizing, dtype=torch.long)]),
                _fingerprint(embeds),
            ]
        )
        self.comm.check_before_next(
            fp.to(self._check_device(ids if ids is not None else embeds)),
            lambda everyone: self._verify_same(everyone, "inputs"),
        )

    @staticmethod
    def _check_device(t):
        return t.device if t is not None and t.device.type == "cuda" else "cpu"

    def check_same_output(self, sequences: torch.Tensor):
        """After generate(): every rank must hold the same sequences (covers what was sampled after
        the last forward, which no forward's input check sees)."""
        # -1 first, which no input check has: a rank still decoding meets a mismatch, not a size error
        fp = _check_vector([-1, *sequences.shape, _fingerprint(sequences)])
        self._verify_same(
            self.comm.all_gather(fp.to(self._check_device(sequences)), tag="control"), "generated sequences"
        )

    def _verify_same(self, everyone, what: str):
        if not bool((everyone == everyone[0]).all()):
            bad = [r for r in range(self.world) if not bool((everyone[r] == everyone[0]).all())]
            raise ContextParallelError(
                f"context-parallel ranks got different {what} (ranks {bad} differ from rank 0: batch, length, "
                "cache length, token contents or output arguments). Every rank must call the model with the same "
                "prompt, mask, cache, logits_to_keep, return_dict and output_hidden_states, and generate() with the "
                "same settings; for sampling, seed every rank identically (e.g. torch.manual_seed(s) on all ranks)."
            )

    def _gather_rows(self, local, gather: Gather):
        """Rows (dim 1, or 0 for batch rows) held by each rank -> all of them in order, identical on every rank."""
        if gather.dim == 0:
            return self._gather_rows(local.transpose(0, 1), Gather(gather.slots, gather.total)).transpose(0, 1)
        counts = [s.numel() for s in gather.slots]
        width = max(counts)
        padded = local.new_zeros((local.shape[0], width, *local.shape[2:]))
        padded[:, : local.shape[1]] = local
        everyone = self.comm.all_gather(padded, tag="control")
        out = local.new_empty((local.shape[0], gather.total, *local.shape[2:]))
        for r, slots in enumerate(gather.slots):
            out[:, slots.to(out.device)] = everyone[r, :, : counts[r]]
        return out


# -- position-dependent RoPE: every rank uses the frequencies of the whole forward -------------
def _position_dependent_rope(module) -> bool:
    """A rotary embedding whose frequencies depend on the longest position in the forward
    (transformers' `dynamic_rope_update`: dynamic NTK scaling, longrope)."""
    rope_type = getattr(module, "rope_type", None)
    if not isinstance(rope_type, (str, dict)):
        return False
    types_ = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
    if not any("dynamic" in t or t == "longrope" for t in types_):
        return False
    if inspect.unwrap(type(module).forward) is type(module).forward:
        raise UnsupportedModelError(
            f"{type(module).__name__} uses {sorted(set(types_))} RoPE without transformers' dynamic_rope_update "
            "decorator, so hf-contextpar cannot give every rank the frequencies of the whole sequence."
        )
    return True


def _global_rope_forward(self, x, position_ids, *args, **kwargs):
    """transformers picks the frequencies from max(position_ids) + 1 of the forward; a rank sees
    only its shard (or its sequences), so update them once from the whole forward's longest
    position, then compute this rank's cos/sin with them."""
    step = current_step.get()
    decorated = type(self).forward
    if step is None:
        return decorated(self, x, position_ids, *args, **kwargs)
    longest = torch.full((1, 1), step.plan.rope_length - 1, dtype=position_ids.dtype, device=position_ids.device)
    decorated(self, x, longest, *args, **kwargs)  # the frequency update, exactly as one process makes it
    return inspect.unwrap(decorated)(self, x, position_ids, *args, **kwargs)


_CANDIDATE_ARGS = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")


def _refuse_candidates_from_embeds(model, args, kwargs):
    """Assisted and prompt-lookup decoding from inputs_embeds: without input_ids transformers drafts
    from the empty input_ids and crops the attention mask to them (one process returns other tokens
    than greedy decoding, or fails inside torch); with them, assisted decoding is not greedy on one
    process either, and prompt lookup under a padding mask and a caller's cache fed the patched
    model a mask that does not match its cache (fuzz seed 900766 case 234 on N = 2). Refused before
    any collective, from the arguments alone."""
    if kwargs.get("inputs_embeds") is None:
        return
    config = kwargs.get("generation_config") or (args[1] if len(args) > 1 else None) or model.generation_config
    asked = [name for name in _CANDIDATE_ARGS if kwargs.get(name) is not None or getattr(config, name, None)]
    if asked:
        raise ContextParallelError(
            f"generate(inputs_embeds=..., {asked[0]}=...): assisted and prompt-lookup decoding from inputs_embeds "
            "are not supported (transformers drafts from input_ids and crops the attention mask to them there: "
            "one process returns other tokens than greedy decoding, or fails inside torch). Pass input_ids "
            "instead of inputs_embeds, or decode without an assistant or prompt lookup."
        )


def _checked_generate(self, *args, **kwargs):
    """model.generate, then one check that every rank returns the same sequences."""
    from .api import get_runtime

    _refuse_candidates_from_embeds(self, args, kwargs)
    out = type(self).generate(self, *args, **kwargs)
    runtime = get_runtime(self)
    if runtime is not None:
        runtime.check_same_output(out if isinstance(out, torch.Tensor) else out.sequences)
    return out
