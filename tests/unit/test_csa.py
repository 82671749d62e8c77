"""CSPS's CSA (issue 41): the approximate mode's settings on one process, and, on N = 2, 3, 4 ranks
(tests/workers/csa_worker.py), its distributed run against its one-process reference and, keeping every token,
against the unpatched model.

This file holds the checks that run in the pytest process; the ones that launch ranks are in tests/multi_process/test_csa.py.
"""

import pytest
import torch
from hf_contextpar.eval.csa_reference import csa_reference

import hf_contextpar
from hf_contextpar.errors import UnsupportedModelError
from hf_contextpar.models import tiny_model
from hf_contextpar.sparse import CSA


def test_levels_and_fractions_follow_the_topology():
    csa = CSA(keep=0.8, topology="2x2x2").resolved(8)
    assert [csa.levels(0, d) for d in range(8)] == [1, 2, 3, 3, 4, 4, 4, 4]
    assert [csa.fraction(v) for v in (1, 2, 3, 4)] == [1.0, 0.8, 0.4, 0.2]
    assert CSA(keep=(0.9, 0.5), topology="2x2").resolved(4).fraction(3) == 0.5
    assert not CSA(keep=1.0, topology="2x2").resolved(4).exact  # the world level keeps half of 1.0
    assert CSA(keep=(1.0, 1.0), topology="2x2").resolved(4).exact
    assert CSA(keep=1.0, topology="1x4").resolved(4).exact  # one node: level 2 alone
    assert CSA(topology=None).resolved(4).topology in (
        (1, 4),
        (
            4 // int(__import__("os").environ.get("LOCAL_WORLD_SIZE", 4)),
            int(__import__("os").environ.get("LOCAL_WORLD_SIZE", 4)),
        ),
    )


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(keep=0.0), "(0, 1]"),
        (dict(keep=(0.3, 0.6)), "not grow"),
        (dict(keep="all"), "fraction"),
        (dict(observe=0), "observe"),
        (dict(topology="2by2"), "'2x2'"),
    ],
)
def test_bad_settings_say_what_is_accepted(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("[", r"\[").replace("]", r"\]")):
        CSA(**kwargs)


def test_a_topology_that_does_not_hold_the_ranks_is_refused():
    with pytest.raises(ValueError, match="A x B = 4"):
        CSA(topology="3x2").resolved(4)


@pytest.mark.parametrize("family", ["llama4_text", "deepseek_v3", "gpt_oss"])
def test_layers_csa_does_not_define_are_refused_at_apply(family):
    with pytest.raises(UnsupportedModelError, match="sparse=CSA"):
        hf_contextpar.apply_context_parallel(tiny_model(family, attn_implementation="eager"), sparse=CSA(keep=0.5))


@pytest.mark.parametrize("family", ["diffllama", "hrm_text", "jetmoe", "moshi"])
def test_families_whose_patch_attends_otherwise_are_refused_at_apply(family):
    """Their family patches change how the layers attend (head experts, value halves, cycles, windowless sliding
    layers): CSA's pruning and reference are not defined for them (the fuzz found DiffLlama's and HRM's CSA off
    their references by 1.9 and 3.3), so CSA is refused; exact runs are not (the census verifies them)."""
    from hybrids import census_family_config
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(census_family_config(family), attn_implementation="sdpa")
    with pytest.raises(UnsupportedModelError, match="not defined for"):
        hf_contextpar.apply_context_parallel(model, sparse=CSA(keep=0.5))


@pytest.mark.parametrize("family", ["zamba", "zamba2"])
def test_an_attention_module_shared_by_several_layers_is_refused_at_apply(family):
    """Zamba's and Zamba2's shared transformer block: one attention module (layer_idx None, or -1) serves several
    layers, which CSA's per-layer pruning and its reference cannot tell apart (the fuzz found Zamba's pruned CSA
    off its reference by 1.28): refused structurally, at apply."""
    from hybrids import census_family_config
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(census_family_config(family), attn_implementation="sdpa")
    with pytest.raises(UnsupportedModelError, match="no layer index of its own"):
        hf_contextpar.apply_context_parallel(model, sparse=CSA(keep=0.5))


def test_sparse_is_never_a_strategy_and_must_be_a_csa():
    assert "csa" not in hf_contextpar.api.STRATEGIES
    with pytest.raises(ValueError, match="sparse must be"):
        hf_contextpar.apply_context_parallel(tiny_model("llama"), sparse=0.5)


def test_the_reference_on_one_partition_is_the_model(monkeypatch):
    """world = 1: one partition, every key level 1: the reference is the unpatched model (its rows taken a few
    at a time, as a long prompt's are)."""
    from hf_contextpar.eval import csa_reference as module

    monkeypatch.setattr(module, "ROWS", 4)
    model = tiny_model("llama", dtype=torch.float64, num_hidden_layers=4)
    ids = torch.randint(0, 256, (2, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(ids).logits
        with csa_reference(model, CSA(keep=0.3, topology="1x1"), 1):
            ref = model(ids).logits
    assert (plain - ref).abs().max().item() < 1e-10
    assert model.config._attn_implementation == "sdpa"  # restored


@pytest.mark.parametrize("family", ["falcon", "gpt_neox_japanese"])
def test_the_reference_prunes_a_ported_family_as_the_distributed_run_does(family):
    """A family whose attention transformers keeps hand-written (patches/ported.py) calls the attention its config
    names only once its patch is in: the reference installs it for the block, as apply_context_parallel does (without
    it the model kept its own attention and the reference was the unpruned model: the fuzz's Falcon cases 1.5 apart),
    and takes it out after."""
    from transformers import AutoModelForCausalLM

    from dev.census.configs import tiny_config

    torch.manual_seed(0)
    config = tiny_config(family, num_hidden_layers=4)  # the middle layers prune (the first and last keep every key)
    impl = hf_contextpar.patches.REGISTRY[family].reference_attn
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64, attn_implementation=impl).eval()
    ids = torch.randint(0, 256, (1, 120), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(ids).logits
        with csa_reference(model, CSA(keep=1.0, topology="3"), 3):
            kept = model(ids).logits
        with csa_reference(model, CSA(keep=0.1, topology="3", observe=8), 3):
            pruned = model(ids).logits
        after = model(ids).logits
    assert (plain - kept).abs().max().item() < 1e-10  # every level keeps every key: the model
    assert (plain - pruned).abs().max().item() > 1e-3  # the middle layers' far keys pruned
    assert torch.equal(after, plain) and not any("forward" in vars(m) for m in model.modules())  # port undone


def test_parse_and_save_round_trip(tmp_path):
    assert CSA.parse("0.8").keep == 0.8 and CSA.parse("0.9,0.5", "2x2").keep == (0.9, 0.5)
    path = CSA(keep=(0.9, 0.5), topology="2x2", observe=16).save(str(tmp_path / "s.json"), note="x")
    assert CSA.parse(path) == CSA(keep=(0.9, 0.5), topology="2x2", observe=16)
    assert CSA.parse(path, topology="1x4").topology == "1x4"
    with pytest.raises(ValueError, match="keep fractions"):
        CSA.parse("most")


def test_the_reference_keeps_each_sequences_own_keys_without_a_mask():
    """A batch with no padding mask: each sequence keeps its own most important keys, as it does alone (the
    fuzz's N = 4 case 95 of seed 0: a mask-less batch of 4 sampled twice each once broke the reference)."""
    model = tiny_model("llama", dtype=torch.float64, num_hidden_layers=4)
    ids = torch.randint(0, 256, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), csa_reference(model, CSA(keep=0.3, topology="2x1", observe=4), 2):
        batch = model(ids).logits
        alone = torch.cat([model(ids[i : i + 1]).logits for i in range(3)])
    assert (batch - alone).abs().max().item() < 1e-10
    with torch.no_grad():
        assert (model(ids).logits - batch).abs().max().item() > 1e-6  # it pruned


def test_balanced_csa_partitions_equalise_the_pruned_work():
    """CSA's default partitions (issue 41): equal predicted work per rank where a query sees only the kept keys of an
    earlier partition at the pruning layers (`SparseRun.pair_weights`, `partitions.weighted`). Keeping all, they
    are the exact chain's balanced ones; pruning, the later ranks take more than they would exact."""
    from hf_contextpar.plan.partitions import balanced, even, weighted
    from hf_contextpar.sparse.csa import SparseRun

    ones = [[1.0] * 4] * 4
    for t in (64, 2048, 16384):
        a, b = weighted(t, 4, 1.0, 1e-2, ones), balanced(t, 4, 0, 1.0, 1e-2)
        assert sum(a) == t and max(abs(x - y) for x, y in zip(a, b)) <= 1, (a, b)
    run = SparseRun.of(CSA(keep=0.6, topology="2x2"), 4, [1, 2, 3, 4, 5])  # needle-lm: 1 sliding, 5 full layers
    assert run.pruning == 3 and run.exact == frozenset({1, 5})
    w = run.pair_weights(4, 6)  # 3 of 6 layers prune: rank 1 sees rank 0 (L2, 0.6) at 1 - 0.5 x 0.4
    assert w[0][1] == pytest.approx(0.8) and w[0][2] == w[1][2] == w[0][3] == pytest.approx(1 - 0.5 * 0.7)
    sizes = weighted(16384, 4, 1.0, 1e-2, w)
    # the work `weighted` equalises: rank d's tokens, its own keys causally, every earlier rank's at its weight
    pairs = [n * (n + 1) / 2 + n * sum(w[s][d] * sizes[s] for s in range(d)) for d, n in enumerate(sizes)]
    work = [sizes[d] + 1e-2 * pairs[d] for d in range(4)]
    assert max(work) / min(work) < 1.01 and sum(sizes) == 16384
    exact = weighted(16384, 4, 1.0, 1e-2, ones)
    assert sizes[0] < exact[0] and all(s > e for s, e in zip(sizes[1:], exact[1:]))  # later ranks see fewer keys
    assert weighted(16384, 4, 1.0, 0.0, w) == [4096] * 4  # no attention term: even
    assert weighted(5, 4, 1.0, 1.0, w) == even(5, 4)  # a partition under 2 tokens: even


def _simulated_csa(n: int, sizes: list, window, keep, layers: int, gen):
    """CSA's algorithm on n simulated ranks (one process, hf_contextpar.tools.selftest.simulated) over `layers`
    layers, full-attention ones (`window` None: the middle ones prune at `keep`) or sliding ones: every rank's
    outputs, the whole-sequence reference for the same Q, K, V and padding, and the ranks' communicators."""
    from hf_contextpar.attention.csa import csa
    from hf_contextpar.cache.sharded import ShardLayout
    from hf_contextpar.plan.forward import build_plan
    from hf_contextpar.plan.policy import Policy, fixed
    from hf_contextpar.sparse.csa import SparseRun
    from hf_contextpar.tools.selftest.simulated import run_algorithm, shard_inputs
    from hf_contextpar.tools.selftest.spec import SCALE, make_padding, reference

    total, batch = sum(sizes), 2
    valid = make_padding(batch, total, gen)
    policy = Policy(n, prefill=fixed("csa"), partitions=lambda t, p: list(sizes))
    plan = build_plan(
        policy,
        ShardLayout(0, n),
        batch=batch,
        num_new=total,
        position_ids=torch.arange(total).expand(batch, -1),
        padding=valid,
    )
    assert plan.algorithm == "csa" and [len(r) for r in plan.shards.token_rows] == sizes
    q = torch.randn(batch, 4, total, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(batch, 2, total, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    run = SparseRun.of(CSA(keep=keep, topology=f"{n}x1", observe=3), n, list(range(layers)) if window is None else [])

    def algorithm(step, q, kv, **attn):
        step.forward.sparse = run  # the forward's setting (every layer's LayerStep reads it there)
        return csa(step, q, kv, **attn)

    qs, kvs = shard_inputs(plan, q, k, v, empty=1e3)
    outs, comms = run_algorithm(plan, qs, kvs, scale=SCALE, window=window, algorithm=algorithm, num_layers=layers)
    return plan, outs, reference(q, k, v, valid, SCALE, window, None), comms


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("window", [2, 3, 9])
def test_a_sliding_layer_sends_the_window_tail_and_stays_exact(n, window):
    """CSA runs a sliding-window layer exact, sending each rank only the window - 1 columns before its partition (the
    tail; window 9 over partitions of 3 to 5 tokens: the tail spans ranks, forwarded from the one before): every
    rank's (out, LSE), padding included, equals whole-sequence attention in fp64."""
    from hf_contextpar.tools.selftest.simulated import local_rows

    sizes = [5, 3, 4, 3][:n]
    plan, outs, (ref_out, ref_lse), comms = _simulated_csa(n, sizes, window, 0.5, 2, torch.Generator().manual_seed(n))
    starts = [sum(sizes[:r]) for r in range(n)]
    row = 2 * 2 * 2 * 8 * 8  # K and V, batch 2, 2 KV heads of 8, fp64
    for r in range(n):
        for out, lse in outs[r]:
            torch.testing.assert_close(out, local_rows(plan, r, ref_out), atol=1e-12, rtol=1e-12)
            torch.testing.assert_close(lse, local_rows(plan, r, ref_lse), atol=1e-12, rtol=1e-12)
        sent = min(window - 1, starts[r + 1]) * row if r < n - 1 else 0
        assert comms[r].tagged["attention"].bytes_sent == 2 * sent  # two layers


@pytest.mark.parametrize("n", [2, 3, 4])
def test_keep_all_csa_posting_receives_ahead_is_exact(n):
    """Three full-attention layers of keep-all CSA (the middle one prunes, keeping every real token, in importance
    order) with the next layer's receives posted during each (the simulated ranks' block geometry is known): every
    rank's (out, LSE) equals whole-sequence attention in fp64, and the pruned layer sends no padding."""
    from hf_contextpar.tools.selftest.simulated import local_rows

    sizes = [6, 4, 5, 3][:n]
    plan, outs, (ref_out, ref_lse), comms = _simulated_csa(
        n, sizes, None, (1.0, 1.0), 3, torch.Generator().manual_seed(7)
    )
    for r in range(n):
        assert len(outs[r]) == 3
        for out, lse in outs[r]:
            torch.testing.assert_close(out, local_rows(plan, r, ref_out), atol=1e-12, rtol=1e-12)
            torch.testing.assert_close(lse, local_rows(plan, r, ref_lse), atol=1e-12, rtol=1e-12)
    if n > 1:
        assert comms[0].tagged["attention"].bytes_sent < 3 * sizes[0] * 2 * 2 * 2 * 8 * 8  # padding stayed home
