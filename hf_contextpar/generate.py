"""What happens around each forward of a patched model: shard the prompt, gather the logits.

A forward pre-hook on the *ForCausalLM module turns the caller's inputs into this rank's share:
- T >= N new tokens (prefill): head-tail sharding (contiguous partitions for KV-Runahead); each
  rank runs the model on its share with global position ids, attention is the chosen prefill
  strategy (attention/), and every rank stores the K/V of its tokens.
- One new token per sequence with B >= N sequences (batched decode, Meta Alg. 4): sequence b runs
  on rank (b + offset) mod N, which stores its K/V; queries travel the ring.
- Otherwise (B < N decode, tiny prompts): every rank runs all T tokens; each token's K/V is
  stored on the least-loaded rank, and attention is sharded-KV decode with an (out, LSE) all-gather.
The forward hook gathers the requested logits (and hidden states) back into original order on
every rank and commits the cache's new global length. `generate()` runs unmodified on top.
"""

from __future__ import annotations

import inspect
from collections import Counter
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicCache

from .attention import current_step
from .cache import ShardedCache
from .comm import Comm
from .errors import ContextParallelError
from .partitions import PartitionTable, even
from .planner import Calibration, ModelShape, choose
from .sharding import contiguous_plan, head_tail_plan, least_loaded_owners


@dataclass
class Step:
    """Everything the attention layers of one forward need to know."""

    comm: Comm
    algorithm: str  # a prefill strategy, "ring_pass_q_decode", "decode" (replicated) or "local"
    q_cols: torch.Tensor  # global columns of this rank's query rows (CPU, ascending)
    q_cols_all: list  # the same for every rank (pass-Q moves queries)
    kv_cols: list  # per rank: global columns of the keys it holds for this forward
    cache: ShardedCache | None
    padding: torch.Tensor | None  # (B, global length) bool, False = padding; None = no padding
    batch: int = 1
    batch_rows: list | None = None  # batched pass-Q decode: per rank, the slice of sequences it runs
    num_layers: int = 0
    layer: int = 0  # index of the attention layer running now
    state: dict = field(default_factory=dict)  # what an algorithm carries from one layer to the next

    def batch_size(self, rank) -> int:
        return len(range(self.batch)[self.batch_rows[rank]])

    def key_valid(self, rank, rows=slice(None)):
        """(B, Tk) bool for rank's keys (rank None: this forward's own), padding = False; None if no padding."""
        if self.padding is None:
            return None
        cols = self.q_cols if rank is None else self.kv_cols[rank]
        pad = self.padding[rows]
        if cols.dim() == 2:
            return pad.gather(1, cols[rows].clamp(min=0).to(pad.device))
        return pad[:, cols.to(pad.device)]


@dataclass
class _Gather:
    """How to reassemble this forward's kept rows: per rank, the output slots its rows fill."""

    slots: list  # per rank: LongTensor of output positions its kept rows fill, in local order
    total: int
    hidden: "_Gather | None" = None  # the same for every row (hidden states), when logits keep fewer
    dim: int = 1  # 1: sequence positions were sharded; 0: batch rows were (batched pass-Q decode)


def _fingerprint(t: torch.Tensor | None) -> int:
    """Cheap order-sensitive hash of a tensor's contents (0 for None)."""
    if t is None:
        return 0
    if t.is_floating_point():
        return int(t.double().sum().view(torch.int64)) ^ int((t.double().flatten()[::97] * 3.1).sum().view(torch.int64))
    flat = t.long().flatten()
    w = torch.arange(1, flat.numel() + 1, device=flat.device) * 1000003 + 7919
    return int((flat * w).sum())


class ContextParallelRuntime:
    """Per-model state: the group, the hooks, and the attention implementation to restore."""

    def __init__(self, model, group, rank, world, strategy: str = "auto", check_inputs: bool = True,
                 calibration=None, planner_rule: str = "alg5", decode: str = "auto", kvr_partitions=None):
        self.model = model
        self.strategy, self.planner_rule, self.decode = strategy, planner_rule, decode
        self.partitions = PartitionTable.load(kvr_partitions) if kvr_partitions is not None else None
        device = next(model.parameters()).device
        self.calibration = Calibration.resolve(calibration, device.type)
        self.shape = ModelShape.from_config(model.config, next(model.parameters()).element_size())
        self.last_decision = None  # the planner's Decision for the latest prefill (strategy="auto")
        self.algorithm_counts = Counter()  # forwards run per attention algorithm (for tests, benchmarks)
        self.comm = Comm(group, rank, world)  # attention traffic: what the strategies move
        self.control = Comm(group, rank, world)  # the input check and the logits gather
        self.last_forward = None  # algorithm, tokens and attention bytes of the latest forward
        self.rank, self.world = rank, world
        self.check_inputs = check_inputs
        self.num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
        self._params = list(inspect.signature(model.forward).parameters)
        self._handles = []
        self._pending = []  # stack of (step token, gather, cache, new length, grad mode, input check) per running forward

    # -- hooks -------------------------------------------------------------------------
    def install(self):
        m = self.model
        self._handles = [
            m.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
            m.register_forward_hook(self._post_forward, with_kwargs=True, always_call=True),
        ]

    def uninstall(self):
        for h in self._handles:
            h.remove()
        self._handles = []

    def _pre_forward(self, module, args, kwargs):
        kwargs = dict(kwargs)
        for name, value in zip(self._params, args):
            kwargs[name] = value
        self._reject_unsupported(kwargs)
        ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
        x = embeds if embeds is not None else ids
        if x is None:
            raise ContextParallelError("pass input_ids or inputs_embeds to the patched model.")
        batch, num_new = x.shape[0], x.shape[1]

        cache = self._resolve_cache(kwargs.get("past_key_values"), kwargs.get("use_cache"))
        past = cache.layout.seq_length if cache is not None else 0
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() != 2:
            raise ContextParallelError(
                "hf-contextpar needs the 2D padding mask (batch, past + new tokens); got a "
                f"{mask.dim()}D attention_mask. Pass the tokenizer's attention_mask instead of a prepared mask."
            )
        if mask is not None and mask.shape[1] != past + num_new:
            raise ContextParallelError(
                f"attention_mask covers {mask.shape[1]} tokens but the cache holds {past} and the input adds "
                f"{num_new}; pass the mask for the whole sequence (past + new), as generate() does."
            )
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            position_ids = (torch.arange(num_new, device=x.device) + past).unsqueeze(0).expand(batch, -1)
        check = None
        if self.check_inputs:
            check = self._post_input_check(batch, num_new, past, ids, embeds, mask, position_ids)
            if num_new >= self.world or past == 0:
                # a prefill's message sizes depend on the inputs: settle the check before the ring starts
                self._verify_same_inputs(check.wait())
                check = None
            # a decode step's check stays in flight under the forward and is settled after it

        new_cols = torch.arange(past, past + num_new)
        batch_rows = None
        if num_new >= self.world:  # shard the new tokens (head-tail, or contiguous for KV-Runahead)
            algorithm, rows = self._prefill_plan(num_new, past, cache)
            mine = rows[self.rank]
            if ids is not None:
                kwargs["input_ids"] = ids[:, mine.to(ids.device)]
            if embeds is not None:
                kwargs["inputs_embeds"] = embeds[:, mine.to(embeds.device)]
            kwargs["position_ids"] = position_ids[:, mine.to(position_ids.device)]
            q_cols, store = new_cols[mine], None
            stored = [new_cols[r] for r in rows]
            q_cols_all = stored
            gather = self._plan_gather(kwargs, rows, num_new)
        elif cache is not None and num_new == 1 and (offset := self._rotation(cache.layout, batch)) is not None:
            # batched ring pass-Q decode: sequence b runs (and stores its token) on rank (b + offset) mod N
            batch_rows = [slice((r - offset) % self.world, None, self.world) for r in range(self.world)]
            mine = batch_rows[self.rank]
            for name in ("input_ids", "inputs_embeds"):
                if kwargs.get(name) is not None:
                    kwargs[name] = kwargs[name][mine]
            kwargs["position_ids"] = position_ids.expand(batch, -1)[mine]
            algorithm, q_cols, q_cols_all = "ring_pass_q_decode", new_cols, [new_cols] * self.world
            cache.layout.begin_rows(past, batch_rows, batch)
            cache.layout.rotation = offset
            everyone = torch.arange(batch)
            gather = _Gather([everyone[rows] for rows in batch_rows], batch, dim=0)
            gather.hidden = gather
        else:  # replicate the few new tokens, store each on the least-loaded rank
            kwargs["position_ids"] = position_ids
            q_cols, gather, q_cols_all = new_cols, None, [new_cols] * self.world
            if cache is not None:
                owned = least_loaded_owners(num_new, cache.layout.counts())
                algorithm, store, stored = "decode", owned[self.rank], [new_cols[o] for o in owned]
            else:
                algorithm, store, stored = "local", None, [new_cols] * self.world

        if cache is not None:
            if algorithm != "ring_pass_q_decode":
                cache.layout.begin(stored, store)
            kv_cols = cache.layout.cols
        else:
            kv_cols = stored
        kwargs["past_key_values"] = cache
        kwargs["use_cache"] = cache is not None
        padding = None if mask is None or bool(mask.all()) else mask.bool()
        step = Step(self.comm, algorithm, q_cols, q_cols_all, kv_cols, cache, padding, batch, batch_rows,
                    self.num_layers)
        self.algorithm_counts[algorithm] += 1
        self.last_forward = dict(algorithm=algorithm, tokens=num_new, past=past,
                                 bytes_sent=-self.comm.stats.bytes_sent, bytes_received=-self.comm.stats.bytes_received)
        token = current_step.set(step)
        # Inference only: the collectives are not differentiable, and autograd would only keep
        # activations alive. The caller's grad mode comes back in the forward hook.
        grad = torch.is_grad_enabled()
        torch.set_grad_enabled(False)
        self._pending.append((token, gather, cache, past + num_new, grad, check))
        return (), kwargs

    def _post_forward(self, module, args, kwargs, output):
        if not self._pending:
            return output
        token, gather, cache, new_length, grad, check = self._pending.pop()
        current_step.reset(token)
        try:
            if check is not None and output is not None:  # output None: the forward raised already
                self._verify_same_inputs(check.wait())
            self.last_forward["bytes_sent"] += self.comm.stats.bytes_sent
            self.last_forward["bytes_received"] += self.comm.stats.bytes_received
            if cache is not None:
                cache.layout.end(new_length)
            if gather is not None and output is not None:
                if getattr(output, "logits", None) is not None:
                    output.logits = self._gather_rows(output.logits, gather)
                if getattr(output, "hidden_states", None) is not None:
                    output.hidden_states = tuple(self._gather_rows(h, gather.hidden) for h in output.hidden_states)
        finally:
            torch.set_grad_enabled(grad)
        return output

    # -- helpers -----------------------------------------------------------------------
    def _rotation(self, layout, batch: int) -> int | None:
        """The offset o for a batched pass-Q decode step (sequence b on rank (b + o) mod N), or None
        for a replicated step. Alg. 4 advances o by one per step; a step runs batched only if every
        sequence's token then lands on one of the ranks holding the fewest of that sequence's tokens,
        so every sequence's shards stay within one token. Right after an uneven prefill the few
        replicated steps that level the shards come first."""
        if self.decode == "replicated":
            return None
        if batch < self.world:
            if self.decode == "ring_pass_q":
                raise ContextParallelError(
                    f"decode='ring_pass_q' needs at least one sequence per rank (batch {batch} < {self.world} ranks); "
                    "use decode='auto', which falls back to replicated sharded-KV decode."
                )
            return None
        counts = layout.sequence_counts(batch)
        least = counts == counts.min(dim=1, keepdim=True).values
        b = torch.arange(batch)
        for step in range(1, self.world + 1):
            offset = (layout.rotation + step) % self.world
            if bool(least[b, (b + offset) % self.world].all()):
                return offset
        return None

    def _prefill_plan(self, num_new: int, past: int, cache):
        """The prefill algorithm for this call and, per rank, the indices of the new tokens it takes."""
        algorithm = self._choose(num_new, past)
        if algorithm == "kv_runahead":
            if past == 0:
                sizes = self.partitions.sizes(num_new, self.world) if self.partitions else even(num_new, self.world)
                return algorithm, contiguous_plan(sizes)
            # the chain needs every earlier token on an earlier rank, which only a fresh prompt has
            algorithm = "ring_pass_kv"
        if algorithm == "ulysses" and cache is not None and any(c.dim() == 2 for c in cache.layout.cols):
            algorithm = "allgather_kv"  # after batched decode no single column order exists to sort keys into
        return algorithm, head_tail_plan(num_new, self.world, cache.layout.counts() if cache is not None else None)

    def _choose(self, num_new: int, past: int) -> str:
        if self.strategy != "auto":
            return self.strategy
        self.last_decision = choose(num_new, past, self.world, self.shape, self.calibration, self.planner_rule)
        return self.last_decision.strategy

    def _reject_unsupported(self, kwargs):
        if kwargs.get("labels") is not None:
            raise ContextParallelError(
                "labels are not supported under context parallelism: compute the loss from the gathered "
                "logits (model(..., logits_to_keep=0).logits), which are identical on every rank."
            )
        if kwargs.get("output_attentions"):
            raise ContextParallelError("output_attentions=True is not supported under context parallelism.")

    def _resolve_cache(self, cache, use_cache):
        if use_cache is None:
            use_cache = getattr(self.model.config.get_text_config(decoder=True), "use_cache", True)
        if isinstance(cache, ShardedCache):
            if cache.layout.world != self.world or cache.layout.rank != self.rank:
                raise ContextParallelError("this ShardedCache belongs to a different context-parallel group.")
            return cache
        if cache is None:
            return ShardedCache(self.num_layers, self.rank, self.world) if use_cache else None
        if type(cache) is DynamicCache and cache.get_seq_length() == 0:  # generate()'s fresh default cache
            return ShardedCache(self.num_layers, self.rank, self.world)
        if isinstance(cache, Cache):
            raise ContextParallelError(
                f"a {type(cache).__name__} cannot be used under context parallelism: each rank keeps its own "
                "ShardedCache. Start from no cache (or generate()'s default) and pass back the "
                "past_key_values the patched model returned; static/quantized/offloaded caches are not supported."
            )
        raise ContextParallelError(f"unsupported past_key_values of type {type(cache).__name__}.")

    def _post_input_check(self, batch, num_new, past, ids, embeds, mask, position_ids):
        """Start the all-gather of every rank's input fingerprint (one small collective per forward)."""
        fp = torch.tensor([batch, num_new, past, _fingerprint(ids), _fingerprint(embeds),
                           _fingerprint(mask), _fingerprint(position_ids)], dtype=torch.long)
        t = ids if ids is not None else embeds
        return self.control.all_gather_start(fp.to(t.device if t.device.type == "cuda" else "cpu"))

    def _verify_same_inputs(self, everyone):
        if not bool((everyone == everyone[0]).all()):
            bad = [r for r in range(self.world) if not bool((everyone[r] == everyone[0]).all())]
            raise ContextParallelError(
                f"context-parallel ranks got different inputs (ranks {bad} differ from rank 0: batch, length, "
                "cache length or token contents). Every rank must call the model with the same prompt, "
                "mask and cache; for sampling, seed every rank identically (e.g. torch.manual_seed(s) on all ranks)."
            )

    def _plan_gather(self, kwargs, rows, num_new):
        """Translate logits_to_keep into this rank's rows and remember where gathered rows go."""
        keep = kwargs.get("logits_to_keep", 0)
        if isinstance(keep, int):
            wanted = torch.arange(num_new - keep if keep > 0 else 0, num_new)
        elif isinstance(keep, torch.Tensor) and keep.dim() == 1 and not keep.dtype == torch.bool:
            wanted = keep.cpu().long() % num_new
        else:
            raise ContextParallelError("under context parallelism logits_to_keep must be an int or a 1D index tensor.")
        owner = torch.empty(num_new, dtype=torch.long)
        local_pos = torch.empty(num_new, dtype=torch.long)
        for r, idx in enumerate(rows):
            owner[idx] = r
            local_pos[idx] = torch.arange(idx.numel())
        slots = [torch.nonzero(owner[wanted] == r).flatten() for r in range(self.world)]
        kwargs["logits_to_keep"] = local_pos[wanted[slots[self.rank]]]
        return _Gather(slots, wanted.numel(), hidden=_Gather(list(rows), num_new))

    def _gather_rows(self, local, gather: _Gather):
        """Rows (dim 1, or 0 for batch rows) held by each rank -> all of them in order, identical on every rank."""
        if gather.dim == 0:
            return self._gather_rows(local.transpose(0, 1), _Gather(gather.slots, gather.total)).transpose(0, 1)
        counts = [s.numel() for s in gather.slots]
        width = max(counts)
        padded = local.new_zeros((local.shape[0], width, *local.shape[2:]))
        padded[:, : local.shape[1]] = local
        everyone = self.control.all_gather(padded)
        out = local.new_empty((local.shape[0], gather.total, *local.shape[2:]))
        for r, slots in enumerate(gather.slots):
            out[:, slots.to(out.device)] = everyone[r, :, : counts[r]]
        return out
