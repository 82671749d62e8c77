"""The forward plan on one process: it is a pure function of replicated inputs, so every shape of
forward (prefill, partial prefill, decode, batched decode, after batched decode, T < N, padding)
can be checked here without starting a process group."""

import random

import pytest
import torch

from hf_contextpar.cache.sharded import ShardLayout
from hf_contextpar.errors import DecodeBatchError
from hf_contextpar.plan.forward import build_plan
from hf_contextpar.plan.policy import Policy, fixed


def plan_for(layout, num_new, batch=1, policy=None, keep=0, uses_cache=True, positions=None):
    policy = policy or Policy(layout.world)
    past = layout.seq_length if uses_cache else 0
    pos = positions if positions is not None else torch.arange(past, past + num_new).expand(batch, -1)
    return build_plan(
        policy,
        layout if uses_cache else None,
        batch=batch,
        num_new=num_new,
        position_ids=pos,
        padding=None,
        logits_to_keep=keep,
        uses_cache=uses_cache,
    )


def stored_columns(layout, batch):
    """Per sequence, the sorted list of global columns stored over all ranks."""
    out = []
    for b in range(batch):
        cols = []
        for c in layout.cols:
            row = c if c.dim() == 1 else c[b]
            cols += [int(x) for x in row if x >= 0]
        out.append(sorted(cols))
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("num_new", [1, 2, 5, 9, 64])
def test_fresh_prefill_covers_every_token_once(world, num_new):
    layout = ShardLayout(0, world)
    plan = plan_for(layout, num_new)
    if num_new < world:
        assert plan.algorithm == "replicated_decode" and plan.shards.token_rows is None
        stores = [s.rows.tolist() for s in plan.storage.store]
        assert sorted(sum(stores, [])) == list(range(num_new))
    else:
        assert plan.algorithm == "ring_pass_kv"
        rows = torch.cat(plan.shards.token_rows).sort().values
        assert torch.equal(rows, torch.arange(num_new))
        sizes = [r.numel() for r in plan.shards.token_rows]
        assert max(sizes) - min(sizes) <= 1
        # the gather puts every kept row back in place
        assert sorted(torch.cat(plan.outputs.logits.slots).tolist()) == list(range(num_new))
    layout.commit(plan.storage)
    assert stored_columns(layout, 1) == [list(range(num_new))]
    assert plan.rope_length == num_new


def test_logits_to_keep_maps_to_the_owning_rank():
    layout = ShardLayout(0, 3)
    plan = plan_for(layout, 11, keep=1)  # only the last position's logits
    owners = [r for r in range(3) if plan.outputs.keep[r].numel()]
    assert len(owners) == 1 and 10 in plan.shards.token_rows[owners[0]][plan.outputs.keep[owners[0]]].tolist()
    assert plan.outputs.logits.total == 1


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    "keep", [0, 1, 3, 11, 12, 40, -2, -11, [0], [-1, 0, 5, 5], [-11, 10], [], [11], [-12]], ids=str
)
def test_logits_to_keep_gathers_what_one_process_keeps(world, keep):
    """The gathered rows are the rows one process keeps: hidden_states[:, slice(-keep, None)] for an
    int (negative and past-the-end ints included), hidden_states[:, index] for an index tensor, whose
    out-of-range entries raise IndexError there too (they once wrapped around here)."""
    num_new = 11
    keep = torch.tensor(keep, dtype=torch.long) if isinstance(keep, list) else keep
    try:
        want = torch.arange(num_new)[slice(-keep, None) if isinstance(keep, int) else keep]
    except IndexError:
        with pytest.raises(IndexError, match="out of range"):
            plan_for(ShardLayout(0, world), num_new, keep=keep)
        return
    plan = plan_for(ShardLayout(0, world), num_new, keep=keep)
    got = torch.empty(plan.outputs.logits.total, dtype=torch.long)
    for r in range(world):  # every rank's kept rows, put where the gather puts them
        got[plan.outputs.logits.slots[r]] = plan.shards.token_rows[r][plan.outputs.keep[r]]
    assert got.tolist() == want.tolist()


def test_partial_prefill_and_decode_keep_shards_level():
    layout = ShardLayout(0, 3)
    for num_new in (10, 1, 1, 7, 1, 2, 30):
        plan = plan_for(layout, num_new)
        layout.commit(plan.storage)
        counts = layout.counts()
        assert max(counts) - min(counts) <= 1
    assert stored_columns(layout, 1) == [list(range(52))]


def test_no_cache_short_forward_is_local():
    plan = plan_for(ShardLayout(0, 4), 3, uses_cache=False)
    assert plan.algorithm == "local" and plan.outputs.logits is None


def test_one_token_prompt_with_batch_ge_n_is_replicated():
    """Batched decode needs a non-empty cache (was an IndexError in the column tables)."""
    plan = plan_for(ShardLayout(0, 2), 1, batch=4)
    assert plan.algorithm == "replicated_decode"


def test_batched_decode_after_a_prefill_and_a_turn_after_it():
    world, batch = 3, 4
    layout = ShardLayout(0, world)
    layout.commit(plan_for(layout, 9, batch=batch).storage)
    algorithms = []
    for _ in range(8):
        plan = plan_for(layout, 1, batch=batch)
        algorithms.append(plan.algorithm)
        if plan.shards.seq_rows is not None:
            ran = sorted(sum((list(range(batch))[s] for s in plan.shards.seq_rows), []))
            assert ran == list(range(batch))  # every sequence runs on exactly one rank
        layout.commit(plan.storage)
        spread = layout.sequence_counts(batch)
        assert int((spread.max(1).values - spread.min(1).values).max()) <= 1
    assert "ring_pass_q_decode" in algorithms
    assert any(c.dim() == 2 for c in layout.cols)
    # a further turn over per-sequence tables: message sizes are the table widths, not their numel
    for strategy in ("ring_pass_kv", "allgather_kv", "kv_runahead", "ulysses"):
        plan = plan_for(layout, 7, batch=batch, policy=Policy(world, prefill=fixed(strategy)))
        assert plan.algorithm == {"kv_runahead": "ring_pass_kv", "ulysses": "allgather_kv"}.get(strategy, strategy)
        for r in range(world):
            assert plan.shards.kv_size(r) == plan.shards.kv_cols[r].shape[-1]
    layout.commit(plan.storage)
    assert stored_columns(layout, batch) == [list(range(24))] * batch


def test_ring_pass_q_decode_below_n_sequences_is_an_error():
    layout = ShardLayout(0, 4)
    layout.commit(plan_for(layout, 8, batch=2).storage)
    with pytest.raises(DecodeBatchError):
        plan_for(layout, 1, batch=2, policy=Policy(4, decode="ring_pass_q"))


def test_kv_runahead_partitions_are_contiguous_on_fresh_prompts_only():
    policy = Policy(3, prefill=fixed("kv_runahead"), partitions=lambda t, p: [t - 2, 1, 1])
    layout = ShardLayout(0, 3)
    plan = plan_for(layout, 10, policy=policy)
    assert [r.tolist() for r in plan.shards.token_rows] == [list(range(8)), [8], [9]]
    layout.commit(plan.storage)
    assert plan_for(layout, 6, policy=policy).algorithm == "ring_pass_kv"


def test_uneven_partitions_level_what_each_rank_keeps():
    """Uneven contiguous partitions commit the even split: each rank keeps its even range of the new columns,
    from its own tokens and the blocks it receives. KV-Runahead sees only earlier ranks' blocks, so only
    front-loaded partitions rebalance there; ring pass-KV sees them all (a chain's later turn, over a cache)."""
    kvr = dict(prefill=fixed("kv_runahead"), rebalance=True)
    plan = plan_for(ShardLayout(0, 3), 11, policy=Policy(3, partitions=lambda t, p: [6, 3, 2], **kvr))
    assert [r.tolist() for r in plan.shards.kv_cols] == [list(range(6)), [6, 7, 8], [9, 10]]
    assert [r.tolist() for r in plan.storage.cols] == [list(range(4)), [4, 5, 6], [7, 8, 9, 10]]  # even(11, 3)
    assert [s.rebalance for s in plan.storage.store] == [(0, 4, 0), (4, 7, 6), (7, 11, 9)]
    for sizes in ([2, 3, 6], [4, 3, 4]):  # back-loaded; already even
        plan = plan_for(ShardLayout(0, 3), 11, policy=Policy(3, partitions=lambda t, p, s=sizes: s, **kvr))
        assert [c.tolist() for c in plan.storage.cols] == [c.tolist() for c in plan.shards.kv_cols]
        assert all(s.rebalance is None for s in plan.storage.store)
    ring = dict(prefill=fixed("ring_pass_kv"), partitions=lambda t, p: [2, 3, 6], chain=True, rebalance=True)
    layout = ShardLayout(0, 3)
    layout.commit(plan_for(layout, 11, policy=Policy(3, **ring)).storage)
    assert [c.tolist() for c in layout.cols] == [list(range(4)), [4, 5, 6], [7, 8, 9, 10]]
    plan = plan_for(layout, 11, policy=Policy(3, **ring))  # a later turn: the new columns 11..21
    assert [s.rebalance for s in plan.storage.store] == [(11, 15, 11), (15, 18, 13), (18, 22, 16)]
    assert [c.tolist()[-3:] for c in plan.storage.cols] == [[12, 13, 14], [15, 16, 17], [19, 20, 21]]
    assert not Policy(3, **{**ring, "rebalance": False}).rebalance


def test_rope_length_is_the_whole_forwards_longest_position():
    """Every rank must see max(position_ids) + 1 of the whole forward, not of its shard or sequences."""
    layout = ShardLayout(0, 2)
    pos = torch.tensor([[1, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]])  # left-padded row, as generate() builds it
    plan = plan_for(layout, 6, batch=2, positions=pos)
    assert plan.rope_length == 6


@pytest.mark.parametrize("seed", range(6))
def test_random_forward_sequences_store_each_token_once(seed):
    """Any sequence of forwards (prefill, decode, batched decode, crops by the cache) keeps one copy
    of every column per sequence, with shards of each sequence within two tokens of each other."""
    rng = random.Random(seed)
    world = rng.choice([2, 3, 4])
    batch = rng.choice([1, world - 1, world, world + 1])
    layout = ShardLayout(0, world)
    for _ in range(12):
        num_new = rng.choice([1, 1, 1, 2, world, 2 * world + 1, 17])
        plan = plan_for(layout, num_new, batch=batch, policy=Policy(world, decode=rng.choice(["auto", "replicated"])))
        layout.commit(plan.storage)
        assert stored_columns(layout, batch) == [list(range(layout.seq_length))] * batch
        counts = layout.sequence_counts(batch)
        assert int((counts.max(1).values - counts.min(1).values).max()) <= 2


def _spread(layout, batch):
    counts = layout.sequence_counts(batch)
    return int((counts.max(1).values - counts.min(1).values).max())


@pytest.mark.parametrize("k", [1, 2, 3, 16])
@pytest.mark.parametrize(
    "world,batch,decode", [(2, 1, "auto"), (3, 2, "auto"), (2, 2, "auto"), (3, 4, "auto"), (3, 4, "replicated")]
)
def test_kv_interleave_places_runs_of_k_and_keeps_shards_within_k(k, world, batch, decode):
    """Decode K/V goes to one rank k tokens at a time (vLLM's cp_kv_cache_interleave_size), each run
    starting on the least-loaded rank; shards stay within k tokens over decode, partial prefill after
    decode and T < N forwards."""
    policy = Policy(world, decode=decode, interleave=k)
    layout = ShardLayout(0, world)
    layout.commit(plan_for(layout, 11, batch=batch, policy=policy).storage)
    owners = []  # per decode step, the rank that stored sequence 0's token
    for num_new in [1] * (3 * k * world + 2) + [9, 1, 1, world - 1, 1, 1]:
        before = layout.sequence_counts(batch)
        plan = plan_for(layout, num_new, batch=batch, policy=policy)
        layout.commit(plan.storage)
        if num_new == 1:
            owners.append(int((layout.sequence_counts(batch) - before)[0].argmax()))
        # a partial prefill evens out the ranks' largest shards, so over per-sequence tables (after
        # batched decode) one sequence can end a token further apart, as with k = 1
        per_sequence = any(c.dim() == 2 for c in layout.cols)
        assert _spread(layout, batch) <= k + per_sequence
        assert stored_columns(layout, batch) == [list(range(layout.seq_length))] * batch
    # once even, runs of exactly k: the owner changes only every k steps
    steady = owners[world : world + 2 * k * world]
    changes = [i for i in range(1, len(steady)) if steady[i] != steady[i - 1]]
    assert all((b - a) == k for a, b in zip(changes, changes[1:])), (k, steady)


def test_kv_interleave_crop_ends_the_open_run():
    """crop (assisted decoding's rejected drafts) may remove the open run's tokens: the next decode
    step starts a new run on the least-loaded rank instead of continuing a run that is gone."""
    from hf_contextpar.cache.sharded import ShardedCache

    policy = Policy(2, interleave=4)
    cache = ShardedCache(1, 0, 2)
    cache.layout.commit(plan_for(cache.layout, 10, policy=policy).storage)
    for _ in range(3):
        cache.layout.commit(plan_for(cache.layout, 1, policy=policy).storage)
    assert cache.layout.run == ("replicated_decode", 0, 3) and cache.layout.counts() == [8, 5]
    cache.crop(-3)
    assert cache.layout.run is None and cache.layout.counts() == [5, 5]
    plan = plan_for(cache.layout, 1, policy=policy)
    assert plan.storage.run == ("replicated_decode", 0, 1)


@pytest.mark.parametrize("bad", [0, -2, 1.0, "2", True, None])
def test_kv_interleave_must_be_a_positive_int(bad):
    import hf_contextpar
    from hf_contextpar.models import tiny_model

    with pytest.raises(ValueError, match="kv_interleave must be a positive int"):
        hf_contextpar.apply_context_parallel(tiny_model("llama"), kv_interleave=bad)


def test_droppable_slots():
    """Sliding layers drop a rank's leading slots whose columns no later query sees; in a per-sequence
    table a slot where some sequence is still empty (-1: its next token goes there) stays."""
    from hf_contextpar.plan.sharding import droppable

    assert droppable(torch.tensor([0, 3, 4, 7, 8]), 5) == 3
    assert droppable(torch.tensor([0, 3, 4]), 0) == 0 and droppable(torch.empty(0, dtype=torch.long), 9) == 0
    table = torch.tensor([[0, 2, 5, 9], [1, 3, -1, -1]])
    assert droppable(table, 4) == 2  # slot 2: sequence 1 is empty there, sequence 0's column 5 is new anyway
    assert droppable(table, 100) == 2  # sequence 1's empty slots are where its next tokens go
    assert droppable(torch.tensor([[0, 2], [-1, -1]]), 100) == 0
    # a hole before a filled slot (a later prefill appended to every sequence) is never filled: it goes
    assert droppable(torch.tensor([[0, -1, 7], [1, 2, 8]]), 5) == 2
    assert droppable(torch.tensor([[0, -1, 7], [1, 2, 8]]), 9) == 3


@pytest.mark.parametrize("world", [2, 3, 4])
def test_chained_plans_cut_contiguous_partitions_of_two_tokens_or_more(world):
    """A model with recurrent layers: every sharded forward (fresh, and over a cache) cuts contiguous
    partitions in rank order of >= 2 tokens (a partition table's too short ones give way to even ones);
    fewer than 2 tokens per rank run on every rank; decode is replicated whatever the batch."""
    policy = Policy(world, prefill=fixed("kv_runahead"), partitions=lambda t, p: [t - world + 1] + [1] * (world - 1))
    policy = Policy(**{**policy.__dict__, "chain": True})
    layout = ShardLayout(0, world)
    for num_new, chained in [(2 * world + 1, True), (2 * world - 1, False), (2 * world, True)]:
        plan = plan_for(layout, num_new, batch=world + 1, policy=policy)
        assert plan.chained == chained
        if chained:
            rows = [r.tolist() for r in plan.shards.token_rows]
            assert sum(rows, []) == list(range(num_new)) and min(len(r) for r in rows) >= 2
            assert plan.algorithm == ("kv_runahead" if layout.seq_length == 0 else "ring_pass_kv")
        else:
            assert plan.algorithm == "replicated_decode"
        layout.commit(plan.storage)
    plan = plan_for(layout, 1, batch=world + 1, policy=policy)
    assert plan.algorithm == "replicated_decode" and not plan.chained


def test_csa_cuts_the_policys_partitions_and_stores_its_own():
    """CSA (issue 41) runs the policy's contiguous partitions (balanced by default) though it cannot rebalance the K/V:
    its blocks travel pruned, so each rank stores its own partition; the prefill is one balanced ones measure."""
    csa = dict(prefill=fixed("csa"), partitions=lambda t, p: [6, 3, 2], rebalance=True)
    plan = plan_for(ShardLayout(0, 3), 11, policy=Policy(3, **csa))
    assert [r.tolist() for r in plan.shards.token_rows] == [list(range(6)), [6, 7, 8], [9, 10]]
    assert [c.tolist() for c in plan.storage.cols] == [c.tolist() for c in plan.shards.kv_cols]
    assert all(s.rebalance is None for s in plan.storage.store) and plan.sized
    chained = plan_for(
        ShardLayout(0, 3), 11, policy=Policy(3, **{**csa, "partitions": lambda t, p: [9, 1, 1]}, chain=True)
    )
    assert [len(r) for r in chained.shards.token_rows] == [4, 3, 4]  # a chained rank needs 2 tokens: even instead
    pass_q = plan_for(ShardLayout(0, 3), 11, policy=Policy(3, **{**csa, "prefill": fixed("ring_pass_q")}))
    assert not pass_q.contiguous and not pass_q.sized  # head-tail: the policy's sizes are a contiguous strategy's


def _prefill_policy(world=2, chain=False, indexed=False, **settings):
    """A model's prefill policy (plan/policy.py) with its settings, on a small cost-model shape."""
    from hf_contextpar.plan.costmodel import Shape
    from hf_contextpar.plan.policy import PrefillPolicy
    from hf_contextpar.settings import Settings

    shape = Shape(layers=2, heads=4, kv_heads=2, head_dim=8, linear_weights=4096, elem_bytes=8)
    s = Settings.of(**settings).resolved("cpu", world)
    indexed = frozenset({0, 1}) if indexed else frozenset()
    policy = PrefillPolicy(world, shape, 2, chain=chain, indexed=indexed, sparse=None, measured=True, rebalance=True)
    return policy, s, shape


def test_auto_weighs_the_records_by_their_flags_and_formulas(monkeypatch):
    """strategy="auto" picks among the strategy records by their flags (the one candidate of a chain, of an indexer)
    and, where several fit, by their `time` formulas (the planner's Decision, kept by the plan): a new record flagged
    `auto` whose formula is the cheapest wins without its name appearing anywhere in the policy."""
    from dataclasses import replace

    from hf_contextpar.plan.choice import choose
    from hf_contextpar.plan.strategies import STRATEGIES

    policy, s, shape = _prefill_policy(chain=True)
    d = policy.of(s).prefill(64, 0)
    assert (d.strategy, d.planner) == ("kv_runahead", None) and "contiguous" in d.why
    policy, s, _ = _prefill_policy(indexed=True)
    assert policy.of(s).prefill(64, 0).strategy == "ring_pass_kv"  # keeps each query (and its top-k) on its rank
    policy, s, _ = _prefill_policy()
    for T, P in ((8, 0), (64, 4096), (4096, 0)):
        d = policy.of(s).prefill(T, P)
        assert d.planner == choose(T, P, 2, shape, s.calibration, "cost") and d.strategy == d.planner.strategy
    policy, s, _ = _prefill_policy(strategy="allgather_kv")
    assert policy.of(s).prefill(64, 0) == policy.of(s).prefill(64, 0) and policy.of(s).prefill(64, 0).planner is None
    free = replace(STRATEGIES["allgather_kv"], name="toy_free", auto=True, time=lambda c: 0.0)
    monkeypatch.setitem(STRATEGIES, "toy_free", free)
    policy, s, _ = _prefill_policy()
    assert policy.of(s).prefill(64, 0).strategy == "toy_free"


def test_the_plan_keeps_the_policys_decision():
    """A prefill's plan keeps what its policy decided, with the strategy it runs and the partitions it cut; a decode
    forward asks the policy nothing."""
    policy, s, _ = _prefill_policy(world=3, chain=True, strategy="kv_runahead", partitions="even")
    layout = ShardLayout(0, 3)
    plan = plan_for(layout, 11, policy=policy.of(s))
    assert plan.decision.strategy == plan.algorithm == "kv_runahead" and plan.decision.partitions == (4, 3, 4)
    layout.commit(plan.storage)
    later = plan_for(layout, 9, policy=policy.of(s))  # over a cache: KV-Runahead's chain runs as ring pass-KV
    assert later.decision.strategy == later.algorithm == "ring_pass_kv" and "fresh prompts only" in later.decision.why
    assert later.decision.partitions == (3, 3, 3)  # the states' chain keeps contiguous partitions
    layout.commit(later.storage)
    assert plan_for(layout, 1, policy=policy.of(s)).decision is None
    policy, s, _ = _prefill_policy(world=3)
    plan = plan_for(ShardLayout(0, 3), 12, policy=policy.of(s))
    assert plan.decision.strategy == plan.algorithm and plan.decision.partitions is None  # head-tail shards
    table = dict(world=3, entries={"12": [0.5, 0.25, 0.25]})  # KVR-P: a table's partitions
    policy, s, _ = _prefill_policy(world=3, strategy="kv_runahead", partitions=table)
    assert plan_for(ShardLayout(0, 3), 12, policy=policy.of(s)).decision.partitions == (6, 3, 3)


def test_batched_decode_hands_each_rank_its_sequences_mask_rows():
    """A rank running some of the sequences (batched decode) gets their rows of the attention mask with their
    tokens: a model may read the mask by its own batch size (CTRL views it as (batch, -1): with the whole batch's
    rows, 8 sequences over 3 ranks failed on two ranks and ran on the third, which then waited for them)."""
    import types

    from hf_contextpar.inputs import shard_inputs

    world, batch = 3, 8
    layout = ShardLayout(0, world)
    layout.commit(plan_for(layout, 9, batch=batch).storage)
    plan = plan_for(layout, 1, batch=batch)
    assert plan.shards.seq_rows is not None
    ids = torch.arange(batch)[:, None]
    mask = torch.arange(batch)[:, None].expand(batch, 10)  # row i holds i
    for rank in range(world):
        kwargs = dict(input_ids=ids, attention_mask=mask, logits_to_keep=0)
        shard_inputs(kwargs, plan, types.SimpleNamespace(position_ids=None, mask=mask), rank, None)
        assert kwargs["attention_mask"].shape == (kwargs["input_ids"].shape[0], 10)
        assert torch.equal(kwargs["attention_mask"][:, 0], kwargs["input_ids"][:, 0])
