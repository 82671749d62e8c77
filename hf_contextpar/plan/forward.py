"""The forward plan: what one forward of a patched model does, decided before it runs.

`build_plan` is a pure function of replicated facts (the caller's inputs, the cache's shard
layout, the settings every rank agreed on at apply time), so every rank builds the same plan
without talking to the others, and it can be tested on one process. For every rank it fixes:
which new tokens (or which sequences) the rank runs, the global columns of its queries, which
new K/V it stores, the key columns every rank holds during the forward (hence every message
size), and how the outputs are gathered back. It comes in three parts, each read by one consumer:
`Shards` (the input split and the attention algorithms, through `Step`), `Storage` (the cache:
told it once by `ShardedCache.begin`, it commits its layout when the forward ends) and `Outputs`
(the output gather). One small builder per shape of forward fills them.

Three shapes of forward:
- T >= N new tokens (prefill): head-tail sharding (contiguous partitions for KV-Runahead); each
  rank runs and stores its share, attention is the chosen prefill strategy.
- One new token per sequence, B >= N sequences, a non-empty cache (batched decode, Meta Alg. 4):
  sequence b runs on rank (b + offset) mod N, which stores its K/V.
- Otherwise (B < N decode, prompts shorter than N): every rank runs all T tokens; each token's
  K/V is stored on one rank ("replicated_decode"), or nowhere without a cache ("local").
Decode placement goes in runs of `Policy.interleave` tokens per rank (vLLM's
cp_kv_cache_interleave_size; 1 by default): the run a decode forward leaves open is part of the
layout (`Storage.run`), so the next forward, one token later, continues it.

Sliding-window layers keep only what a later query can see, as transformers' sliding cache does
(the last window - 1 columns): on every rank they drop the leading key slots whose columns are all
older than that (`Storage.dropped`, per window, committed by the cache when the forward ends), so their
K/V blocks, hence their message sizes, are the layout's minus those slots (`Shards.kv_cols_for`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import torch

from ..errors import DecodeBatchError, UnsupportedInputError
from .partitions import even
from .policy import Policy, PrefillDecision
from .sharding import (
    contiguous_plan,
    decode_owners,
    head_tail_plan,
    rank_counts,
    rank_tokens,
    sequence_counts,
    window_drops,
)
from .strategies import STRATEGIES


@dataclass(frozen=True)
class Gather:
    """How to reassemble kept output rows: per rank, the output slots its rows fill."""

    slots: list  # per rank: LongTensor of output positions its rows fill, in local order
    total: int
    dim: int = 1  # 1: sequence positions were sharded; 0: batch rows were (batched decode)


@dataclass(frozen=True)
class RankCommit:
    """Which of the K/V a rank computes in this forward it keeps."""

    rows: torch.Tensor | None = None  # ascending indices into the rank's new tokens; None: all of them
    slots: tuple | None = None  # batched decode: (sequence indices, slot of each in the rank's buffer)
    # uneven contiguous partitions' rebalancing (`_rebalanced`): (lo, hi, start) keeps the new columns [lo, hi), from
    # the blocks it receives and its own (which start at column `start`), so every rank commits an even share
    rebalance: tuple | None = None


@dataclass(frozen=True)
class Shards:
    """Who runs what, and which keys every rank holds: what the runtime's input split and the
    attention algorithms (through `Step`) read."""

    token_rows: list | None  # sequence sharding: per rank, indices of the new tokens it runs
    seq_rows: list | None  # batched decode: per rank, the slice of sequences it runs
    q_cols: list  # per rank: global columns of its query rows (1D, ascending)
    kv_cols: list  # per rank: columns of the keys it holds during the forward, 1D or (B, slots) (-1: empty)
    window_cols: dict = field(default_factory=dict)  # window -> per rank: the keys its sliding layers hold

    def kv_cols_for(self, window: int | None) -> list:
        """Per rank: the key columns a layer with this cache window holds during the forward."""
        return self.window_cols.get(window, self.kv_cols)

    def kv_size(self, rank: int, window: int | None = None) -> int:
        """Tokens in rank's K/V block (slots, for per-sequence tables): every message size."""
        return self.kv_cols_for(window)[rank].shape[-1]


@dataclass(frozen=True)
class Storage:
    """What the cache stores in this forward and the layout it commits when the forward ends."""

    store: list  # per rank: RankCommit
    cols: list  # per rank: the layout's columns once committed (Shards.kv_cols)
    seq_length: int
    batch: int
    rotation: int  # the layout's batched-decode offset after this forward
    run: tuple | None  # the decode run left open: (algorithm, rank or offset, tokens placed); None: none
    dropped: dict = field(default_factory=dict)  # window -> per rank: slots its layers have dropped once committed


@dataclass(frozen=True)
class Outputs:
    """Which output rows each rank computes and where they go: what the output gather reads."""

    keep: list | None  # per rank: local logits_to_keep (sequence sharding), None: the caller's
    logits: Gather | None  # None: every rank computed every row
    hidden: Gather | None  # hidden states (every row)


@dataclass(frozen=True)
class ForwardPlan:
    algorithm: str  # a prefill strategy, "ring_pass_q_decode", "replicated_decode" or "local"
    world: int
    batch: int
    num_new: int
    past: int
    rope_length: int  # max position + 1 over the whole forward: what position-dependent RoPE sees
    padding: torch.Tensor | None  # (B, past + T) bool, False = padding; None when nothing is padded
    shards: Shards
    storage: Storage | None  # None: the forward runs without a cache
    outputs: Outputs
    chained: bool = False  # recurrent layers pass their states down the ranks (contiguous partitions in order)
    decision: PrefillDecision | None = None  # a prefill: what the policy decided, with the partitions cut

    @property
    def seq_length(self) -> int:
        return self.past + self.num_new

    @property
    def contiguous(self) -> bool:
        """Each rank runs one contiguous partition of the new tokens, in rank order (a chain, KV-Runahead)."""
        return self.shards.token_rows is not None and (self.chained or STRATEGIES[self.algorithm].contiguous)

    @property
    def sized(self) -> bool:
        """Contiguous partitions the policy's sizes may cut unevenly (a chain, KV-Runahead, CSA): the prefills whose
        busy times balanced partitions learn from (policy.PrefillPolicy.measure; CSA's cut from the model's terms alone)."""
        return self.contiguous and (self.chained or STRATEGIES[self.algorithm].cuts_unevenly)


@dataclass(frozen=True)
class _Before:
    """What the plan reads of the cache's layout (an empty one without a cache)."""

    past: int
    cols: list
    rotation: int
    run: tuple | None
    dropped: dict
    record_past: bool

    @staticmethod
    def of(layout, world: int, uses_cache: bool):
        if not uses_cache:
            return _Before(0, [torch.empty(0, dtype=torch.long)] * world, -1, None, {}, False)
        return _Before(layout.seq_length, layout.cols, layout.rotation, layout.run, layout.dropped, layout.record_past)


def build_plan(
    policy: Policy,
    layout,
    *,
    batch: int,
    num_new: int,
    position_ids: torch.Tensor,
    padding: torch.Tensor | None,
    logits_to_keep=0,
    uses_cache: bool = True,
) -> ForwardPlan:
    """This forward's plan. `layout` is the cache's ShardLayout (None without a cache); nothing is modified."""
    before = _Before.of(layout, policy.world, uses_cache)
    new_cols = torch.arange(before.past, before.past + num_new)
    # a chained rank's recurrent mixers take its padding from its own >= 2 tokens (transformers reads a 1-token
    # forward as decode, unmasked): fewer tokens run on every rank
    decision = None
    if num_new >= policy.world * (2 if policy.chain else 1):
        decision, shards, storage, outputs = _shard_tokens(policy, before, new_cols, logits_to_keep)
        algorithm = decision.strategy
    else:
        offset, run = (
            _rotation(policy, before.cols, before.rotation, batch, before.run)
            if uses_cache and num_new == 1 and before.past > 0
            else (None, None)
        )
        if offset is not None:
            algorithm, shards, storage, outputs = _batched_decode(policy, before, new_cols, batch, offset, run)
        elif uses_cache:
            algorithm, shards, storage, outputs = _replicated_decode(policy, before, new_cols, batch)
        else:
            algorithm, shards, storage, outputs = _local(policy, new_cols)
    if storage is not None:
        storage = Storage(
            **storage, seq_length=before.past + num_new, batch=batch, dropped=_dropped(before, storage["cols"], num_new)
        )
        if before.dropped:  # sliding layers hold fewer keys: their columns and message sizes
            cols = {w: [c[..., d:] if d else c for c, d in zip(shards.kv_cols, ds)] for w, ds in before.dropped.items()}
            shards = replace(shards, window_cols=cols)
    return ForwardPlan(
        algorithm=algorithm,
        world=policy.world,
        batch=batch,
        num_new=num_new,
        past=before.past,
        rope_length=int(position_ids.max()) + 1,
        padding=padding,
        shards=shards,
        storage=storage,
        outputs=outputs,
        chained=policy.chain and shards.token_rows is not None,
        decision=decision,
    )


def _shard_tokens(policy: Policy, before: _Before, new_cols, logits_to_keep):
    """Prefill (T >= N): each rank runs and stores its share of the new tokens."""
    decision, rows = _prefill(policy, before.cols, new_cols.numel(), before.past)
    algorithm = decision.strategy
    q_cols = [new_cols[r] for r in rows]
    kv_cols = _append(before.cols, q_cols)
    keep, gather = _token_gather(rows, new_cols.numel(), logits_to_keep)
    shards = Shards(token_rows=rows, seq_rows=None, q_cols=q_cols, kv_cols=kv_cols)
    contiguous = policy.chain or STRATEGIES[algorithm].contiguous
    flat = all(c.dim() == 1 for c in before.cols)
    rebalanced = _rebalanced(q_cols, algorithm) if policy.rebalance and contiguous and flat else None
    store, kept = rebalanced or ([RankCommit()] * policy.world, q_cols)
    storage = dict(store=store, cols=_append(before.cols, kept), rotation=before.rotation, run=None)
    return decision, shards, storage, Outputs(keep=keep, logits=gather, hidden=Gather(list(rows), new_cols.numel()))


def _rebalanced(q_cols, algorithm: str):
    """Uneven contiguous partitions (balanced ones, a table's) leave the earlier ranks more K/V. But a rank
    sees every other rank's new block under ring pass-KV and all-gather KV, and every earlier one under
    KV-Runahead, so it can keep its even range of the new columns with no message more (KV-Runahead:
    where that range ends within its own partition, as front-loaded partitions have it). Returns
    (stores, each rank's new columns), or None where the partitions are even or it cannot."""
    starts, ends = [int(c[0]) for c in q_cols], [int(c[-1]) + 1 for c in q_cols]
    bounds = [starts[0] + b for b in (0, *itertools.accumulate(even(ends[-1] - starts[0], len(q_cols))))]
    brings = STRATEGIES[algorithm].brings_kv
    earlier_only = brings == "earlier" and any(b > e for b, e in zip(bounds[1:], ends))
    if starts == bounds[:-1] or earlier_only or brings is None:
        return None
    store = [RankCommit(rebalance=(a, b, s)) for a, b, s in zip(bounds, bounds[1:], starts)]
    return store, [torch.arange(a, b) for a, b in zip(bounds, bounds[1:])]


def _batched_decode(policy: Policy, before: _Before, new_cols, batch: int, offset: int, run):
    """Batched ring pass-Q decode (Alg. 4): sequence b runs on rank (b + offset) mod N, which stores its K/V."""
    world = policy.world
    seq_rows = [slice((r - offset) % world, None, world) for r in range(world)]
    kv_cols, store = _place_per_sequence(before.cols, before.past, seq_rows, batch)
    everyone = torch.arange(batch)
    gather = Gather([everyone[s] for s in seq_rows], batch, dim=0)
    shards = Shards(token_rows=None, seq_rows=seq_rows, q_cols=[new_cols] * world, kv_cols=kv_cols)
    storage = dict(store=store, cols=kv_cols, rotation=offset, run=run)
    return "ring_pass_q_decode", shards, storage, Outputs(keep=None, logits=gather, hidden=gather)


def _replicated_decode(policy: Policy, before: _Before, new_cols, batch: int):
    """Every rank runs every new token; each token's K/V is stored on one rank."""
    continuing = before.run[1:] if before.run is not None and before.run[0] == "replicated_decode" else None
    num_new = new_cols.numel()
    owned, run = decode_owners(num_new, rank_tokens(before.cols, batch), policy.interleave, continuing)
    stored = [_owned_cols(new_cols, o, num_new) for o in owned]
    kv_cols = _append(before.cols, stored)
    shards = Shards(token_rows=None, seq_rows=None, q_cols=[new_cols] * policy.world, kv_cols=kv_cols)
    storage = dict(
        store=[RankCommit(rows=o) for o in owned],
        cols=kv_cols,
        rotation=before.rotation,
        run=("replicated_decode", *run) if run is not None else None,
    )
    return "replicated_decode", shards, storage, Outputs(keep=None, logits=None, hidden=None)


def _local(policy: Policy, new_cols):
    """No cache and fewer tokens than ranks: every rank runs every token on its own."""
    shards = Shards(token_rows=None, seq_rows=None, q_cols=[new_cols] * policy.world, kv_cols=[new_cols] * policy.world)
    return "local", shards, None, Outputs(keep=None, logits=None, hidden=None)


def _dropped(before: _Before, cols, num_new: int) -> dict:
    """Per window, per rank: what the sliding layers hold once the forward is committed. A window's
    layers drop every leading slot older than length - window + 1 (`window_drops`), except while
    the cache records the past (transformers keeps every token until crop() then)."""
    if not before.dropped or before.record_past:
        return before.dropped
    return window_drops(cols, before.past + num_new, before.dropped)


def _prefill(policy: Policy, cols, num_new: int, past: int):
    """What the policy decided, with the strategy this prefill runs and the partitions it cuts, and per rank the
    indices of the new tokens it takes."""
    decision = policy.prefill(num_new, past)
    record = STRATEGIES[decision.strategy]
    if past and record.fresh_only:  # KV-Runahead's chain needs every earlier token on an earlier rank
        why = f"{decision.why}; {record.over_cache} over a cache ({record.name} runs on fresh prompts only)"
        decision = replace(decision, strategy=record.over_cache, why=why)
        record = STRATEGIES[record.over_cache]
    if policy.chain or record.contiguous:  # the states' chain, KV-Runahead's, CSA's: in rank order,
        # uneven only where the K/V can be rebalanced (pass-Q and Ulysses move no whole K/V) or the strategy stores its
        # own partitions (CSA)
        uneven = policy.partitions is not None and record.cuts_unevenly
        sizes = policy.partitions(num_new, past) if uneven else None
        least = 2 if policy.chain else 0  # a chained rank's recurrent mixers need >= 2 tokens
        cut = sizes if sizes and min(sizes) >= least else even(num_new, policy.world)
        return replace(decision, partitions=tuple(cut)), contiguous_plan(cut)
    if record.over_tables and any(c.dim() == 2 for c in cols):
        why = f"{decision.why}; {record.over_tables} after batched decode (no single column order exists)"
        decision = replace(decision, strategy=record.over_tables, why=why)
    return decision, head_tail_plan(num_new, policy.world, rank_counts(cols))


def _owned_cols(new_cols, owned, num_new: int):
    """A rank's new columns in replicated decode: all of them, none (its empty indices, which _append skips) or the
    ones it owns; the first two without an index op (tensor ops cost microseconds, and this runs every step)."""
    if owned.numel() == num_new:
        return new_cols
    if owned.numel() == 0:
        return owned
    return new_cols[owned]


def _append(cols, new_cols):
    """Every sequence appends the same columns (new_cols[r] on rank r). A rank that stores none keeps its
    tensor (layouts are never written in place): in replicated decode all but one rank, every step."""
    return [_appended(c, n) for c, n in zip(cols, new_cols)]


def _appended(cols, new):
    """One rank's columns with `new` after them: a 1-D layout (every sequence alike) or one row per sequence."""
    if new.numel() == 0:
        return cols
    if cols.dim() == 1:
        return torch.cat([cols, new])
    return torch.cat([cols, new.expand(cols.shape[0], -1)], dim=1)


def _rotation(policy: Policy, cols, rotation: int, batch: int, open_run) -> tuple:
    """(offset o, open run) of a batched decode step (sequence b on rank (b + o) mod N), or (None,
    None) for a replicated step. Alg. 4 advances o by one per step (every `policy.interleave` steps:
    an open run keeps its offset while no sequence's rank would get more than `interleave` tokens
    ahead of that sequence's smallest shard). A new offset is taken only if every sequence's token
    then lands on one of the ranks holding the fewest of that sequence's tokens, so every sequence's
    shards stay within `interleave` tokens. Right after an uneven prefill the few replicated steps
    that even out the shards come first."""
    world = policy.world
    if policy.decode == "replicated" or policy.chain:  # recurrent states: every rank holds them all
        return None, None
    if batch < world:
        if policy.decode == "ring_pass_q":
            raise DecodeBatchError(
                f"decode='ring_pass_q' needs at least one sequence per rank (batch {batch} < {world} ranks); "
                "use decode='auto', which falls back to replicated decode."
            )
        return None, None
    counts = sequence_counts(cols, batch)
    low = counts.min(dim=1).values
    b = torch.arange(batch)
    if open_run is not None and open_run[0] == "ring_pass_q_decode" and open_run[2] < policy.interleave:
        offset = open_run[1]
        if bool((counts[b, (b + offset) % world] - low < policy.interleave).all()):
            return offset, (open_run[0], offset, open_run[2] + 1)
    for step in range(1, world + 1):
        offset = (rotation + step) % world
        if bool((counts[b, (b + offset) % world] == low).all()):
            return offset, ("ring_pass_q_decode", offset, 1)
    return None, None


def _place_per_sequence(cols, col: int, seq_rows, batch: int):
    """One new column per sequence; rank r stores it for the sequences seq_rows[r], in the slot
    after that sequence's last filled one. Returns the new (B, slots) tables and each rank's RankCommit."""
    new_cols, store = [], []
    for rows, c in zip(seq_rows, cols):
        c = c.expand(batch, -1).clone() if c.dim() == 1 else c.clone()
        idx = torch.arange(batch)[rows]
        # slot after the last filled one (0 for a sequence with nothing here; no argmax over empty tables)
        filled_upto = (
            ((c >= 0) * torch.arange(1, c.shape[1] + 1)).amax(1) if c.shape[1] else torch.zeros(batch, dtype=torch.long)
        )
        slots = filled_upto[idx]
        need = int(slots.max()) + 1 if idx.numel() else 0
        if need > c.shape[1]:
            c = torch.cat([c, c.new_full((batch, need - c.shape[1]), -1)], dim=1)
        c[idx, slots] = col
        new_cols.append(c)
        store.append(RankCommit(slots=(idx, slots)))
    return new_cols, store


def _token_gather(rows, num_new: int, logits_to_keep):
    """Translate logits_to_keep into each rank's local rows and where the gathered rows go."""
    keep = logits_to_keep
    if isinstance(keep, int):  # what the models do: hidden_states[:, slice(-keep, None)]
        wanted = torch.arange(num_new)[slice(-keep, None)]
    elif isinstance(keep, torch.Tensor) and keep.dim() == 1 and keep.dtype != torch.bool:
        wanted = keep.cpu().long()
        if wanted.numel() and not (-num_new <= int(wanted.min()) and int(wanted.max()) < num_new):
            raise IndexError(  # as indexing the hidden states raises on one process
                f"logits_to_keep holds an index out of range for {num_new} new tokens: {keep.tolist()}."
            )
        wanted = wanted % num_new
    else:
        raise UnsupportedInputError("under context parallelism logits_to_keep must be an int or a 1D index tensor.")
    world = len(rows)
    owner = torch.empty(num_new, dtype=torch.long)
    local_pos = torch.empty(num_new, dtype=torch.long)
    for r, idx in enumerate(rows):
        owner[idx] = r
        local_pos[idx] = torch.arange(idx.numel())
    slots = [torch.nonzero(owner[wanted] == r).flatten() for r in range(world)]
    return [local_pos[wanted[s]] for s in slots], Gather(slots, wanted.numel())
