"""Bad input fails with a clear error, on every rank, instead of a hang or a wrong answer.

This file holds the checks that run in the pytest process; the ones that launch ranks are in tests/multi_process/test_errors.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_contextpar
from dev.census.configs import tiny_config
from hf_contextpar.models import tiny_model


def test_bad_strategy():
    with pytest.raises(ValueError, match="strategy must be one of"):
        hf_contextpar.apply_context_parallel(tiny_model("llama"), strategy="bogus")
    with pytest.raises(ValueError, match="planner_rule must be one of"):  # at apply, not at the first forward
        hf_contextpar.apply_context_parallel(tiny_model("llama"), planner_rule="bogus")


def _from_config(model_type, **kw):
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw))


def _unverified_rwkv():
    from transformers import RwkvConfig, RwkvForCausalLM

    class Unverified(RwkvConfig):
        model_type = "rwkv_unverified"

    return RwkvForCausalLM(Unverified(num_hidden_layers=2, hidden_size=64, intermediate_size=64, vocab_size=64))


@pytest.mark.parametrize(
    "build,needle",
    [
        # a family refused whatever a user registers (patches.INEXACT), with the reason read from its code: CPM-Ant's
        # prefill attends both ways (the census's not-verified path: tests/*/test_census.py)
        (
            lambda: _from_config(
                "cpmant",
                num_hidden_layers=1,
                hidden_size=32,
                num_attention_heads=2,
                dim_head=16,
                dim_ff=32,
                vocab_size=64,
            ),
            "registered or not: CpmAntModel.forward masks its prefill bidirectionally",
        ),
        # a text model of Gemma 4 Unified whose every token attends to later ones (its default, "vision", is causal)
        (
            lambda: AutoModelForCausalLM.from_config(
                type(tiny_config("gemma4_unified_text"))(
                    **{**tiny_config("gemma4_unified_text").to_dict(), "use_bidirectional_attention": "all"}
                )
            ),
            "use_bidirectional_attention='all'",
        ),
        # families the census found cannot run exact, refused at apply with their own reason before a generic check
        # trips on their structure (BLT's top config declares no attention heads): its own tests' config
        (
            lambda: AutoModelForCausalLM.from_config(tiny_config("blt")),
            "'blt' cannot run .*registered or not: its global transformer attends over patches",
        ),
        # xLSTM's training backend runs its chunkwise kernel over the whole sequence, with no state to continue from
        (
            lambda: AutoModelForCausalLM.from_config(
                type(tiny_config("xlstm"))(**{**tiny_config("xlstm").to_dict(), "mode": "train"})
            ),
            "xLSTM's mode='train' runs the chunkwise kernel over the whole sequence",
        ),
        # Gemma 4's drafters: built as a user would, though their forward needs the target model's states
        (
            lambda: AutoModelForCausalLM.from_config(tiny_config("gemma4_assistant")),
            "'gemma4_assistant' cannot run .*draft model for assisted decoding",
        ),
        (
            lambda: AutoModelForCausalLM.from_config(tiny_config("gemma4_unified_assistant")),
            "'gemma4_unified_assistant' cannot run .*draft model for assisted decoding",
        ),
        # Dory's loops before the last attending the cache's stored K/V read directly (its per-loop mode runs)
        (
            lambda: AutoModelForCausalLM.from_config(
                type(tiny_config("dory"))(**{**tiny_config("dory").to_dict(), "recurrent_kv_cache_mode": "last_loop"})
            ),
            "recurrent_kv_cache_mode='last_loop'",
        ),
        # no attention heads at all, a recurrence of a family not verified (RWKV's blocks under another model_type,
        # as a remote-code variant would be; RWKV's own runs through patches/rwkv.py): refused at apply, not a crash
        # in the cost model
        (_unverified_rwkv, "declares no attention heads"),
        # a 1-token window: transformers' own cached decode differs from a recompute, nothing to match
        (
            lambda: _from_config(
                "mistral",
                num_hidden_layers=1,
                hidden_size=32,
                intermediate_size=32,
                num_attention_heads=2,
                num_key_value_heads=1,
                vocab_size=64,
                sliding_window=1,
            ),
            "at least 2",
        ),
    ],
)
def test_unsupported_models_are_rejected(build, needle):
    with pytest.raises(hf_contextpar.UnsupportedModelError, match=needle):
        hf_contextpar.apply_context_parallel(build())


def test_encoder_decoder_rejected():
    from transformers import AutoModelForSeq2SeqLM

    t5 = AutoModelForSeq2SeqLM.from_config(
        AutoConfig.for_model("t5", d_model=32, d_ff=32, num_layers=1, num_heads=2, d_kv=16, vocab_size=64)
    )
    with pytest.raises(hf_contextpar.UnsupportedModelError, match="encoder-decoder"):
        hf_contextpar.apply_context_parallel(t5)


def test_gemma3_multimodal_rejected():
    from hf_contextpar import patches

    with pytest.raises(hf_contextpar.UnsupportedModelError, match="Gemma3ForCausalLM"):
        patches.resolve(AutoConfig.for_model("gemma3"))


def test_single_process_is_a_faithful_no_op():
    model = tiny_model("qwen3")
    ref = tiny_model("qwen3")
    assert hf_contextpar.apply_context_parallel(model) is model
    ids = torch.randint(0, 256, (2, 33))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    assert model.config._attn_implementation == "sdpa"


def test_the_partitions_former_name_still_works_with_a_warning():
    """partitions= was kvr_partitions= before it governed CSA's and the recurrent chain's partitions too: the old
    keyword is read as the new one with a DeprecationWarning; both at once are refused."""
    model = tiny_model("qwen3")
    with pytest.warns(DeprecationWarning, match="partitions="):
        assert hf_contextpar.apply_context_parallel(model, kvr_partitions="even") is model
    with pytest.raises(ValueError, match="not both"):
        hf_contextpar.apply_context_parallel(model, partitions="even", kvr_partitions="even")
    assert hf_contextpar.apply_context_parallel(model, partitions="balanced") is model


@pytest.mark.parametrize(
    "strategy,decode,dcp,sparse,needle",
    [
        ("ring_pass_q", "auto", False, None, "strategy='ring_pass_q'"),
        ("ulysses", "auto", False, None, "strategy='ulysses'"),
        ("auto", "ring_pass_q", False, None, "decode='ring_pass_q'"),
        ("ring_pass_kv", "auto", True, None, "DCP"),
        ("auto", "replicated", False, "csa", "sparse=CSA"),
    ],
)
def test_indexed_attention_refuses_what_moves_a_query_from_its_top_k(strategy, decode, dcp, sparse, needle):
    """DSA: each query's top-k is chosen on the rank that runs it; what would attend it elsewhere is refused at
    apply, by name (the rest runs: ring pass-KV, all-gather KV, KV-Runahead, replicated decode)."""
    from types import SimpleNamespace

    from hf_contextpar.attention.indexed import check_indexed
    from hf_contextpar.model.families import hooks_of
    from hf_contextpar.models import tiny_config as tiny

    for config in (tiny("deepseek_v32"), tiny_config("minimax_m3_vl_text")):  # MiniMax-M3's block indexer too
        kind = hooks_of(config).indexed_layer_type()
        with pytest.raises(hf_contextpar.UnsupportedModelError, match=needle.replace("(", r"\(")):
            check_indexed(config, SimpleNamespace(strategy=strategy, decode=decode, sparse=sparse), dcp, kind)
        for ok in ("auto", "ring_pass_kv", "allgather_kv", "kv_runahead"):
            assert check_indexed(config, SimpleNamespace(strategy=ok, decode="replicated", sparse=None), False, kind)
    assert not check_indexed(
        tiny("deepseek_v3"), SimpleNamespace(strategy="ring_pass_q", decode="auto", sparse=None), False
    )


def _runtime(model, world: int, **settings):
    """The runtime apply builds on rank 0 of `world` ranks, after the settings agreement (one process: no message
    is sent while it is built), so what it refuses is what apply refuses on every rank alike."""
    from hf_contextpar.runtime import ContextParallelRuntime
    from hf_contextpar.settings import Settings

    agreed = Settings.of(check_inputs=False, **settings).resolved("cpu", world)
    return ContextParallelRuntime(model, None, 0, world, agreed)


def test_a_new_capability_is_its_room_and_one_record_entry(monkeypatch):
    """A capability the library does not ship, defined here as a new one would be (its own check, one entry in the
    capability record, hf_contextpar/capabilities.py): apply runs it with the shipped ones, in one place, and its
    refusal reaches the caller as theirs do (whole heads': N not dividing the heads); what it returns is what the
    forwards read of it."""
    from hf_contextpar import capabilities

    def toy(facts):  # "pass-Q cannot run a model whose embeddings are tied": a made-up limit, for the test only
        tied = bool(facts.config.tie_word_embeddings)
        if tied and facts.settings.strategy == "ring_pass_q":
            raise hf_contextpar.UnsupportedModelError("toy capability: tied embeddings under strategy='ring_pass_q'")
        return tied

    monkeypatch.setitem(capabilities.RECORD, "toy", capabilities.Capability("toy", toy))
    model = tiny_model("llama", tie_word_embeddings=True)
    assert _runtime(model, 2).patched.capabilities == {
        "tensor_parallel": 1,
        "whole_heads": False,
        "indexed": frozenset(),
        "chain": False,
        "csa": None,
        "toy": True,
    }
    with pytest.raises(hf_contextpar.UnsupportedModelError, match="toy capability"):
        _runtime(model, 2, strategy="ring_pass_q")
    heads = model.config.num_key_value_heads
    with pytest.raises(hf_contextpar.HeadsNotDivisibleError, match="does not divide"):  # a shipped one, same path
        _runtime(model, heads + 1, strategy="ulysses")
    monkeypatch.delitem(capabilities.RECORD, "toy")
    _runtime(model, 2, strategy="ring_pass_q")  # without the entry the toy refuses nothing: the record is the route


def test_a_family_whose_attention_cannot_split_its_heads_is_refused_under_tensor_parallelism():
    """MiniMax-M3's block indexer selects per KV head of the whole model (FamilyHooks.tensor_parallel): with its heads
    split over TP ranks it is refused at apply with what to do, not failed inside the kernel; without TP it runs."""
    from hf_contextpar import mesh
    from hf_contextpar.capabilities import Facts

    model = AutoModelForCausalLM.from_config(tiny_config("minimax_m3_vl_text"))
    facts = lambda tp: Facts(model, None, 2, tp, None, None, False)  # noqa: E731
    with pytest.raises(hf_contextpar.UnsupportedModelError, match=r"tensor parallelism \(tp=2\).*use more context"):
        mesh.check(facts(2))
    assert mesh.check(facts(1)) == 1
    llama = tiny_model("llama")
    assert mesh.check(Facts(llama, None, 2, 2, None, None, False)) == 2  # a family that splits its heads: no refusal
