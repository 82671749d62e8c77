"""Bad input fails with a clear error, on every rank, instead of a hang or a wrong answer."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_contextpar
from dev.census.configs import tiny_config
from hf_contextpar.models import tiny_model

sys.path.insert(0, os.path.dirname(__file__))
from launch import launch  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "error_worker.py")


def _results(procs):
    return [[line[7:] for line in out.splitlines() if line.startswith("RESULT ")] for _, out, _ in procs]


# scenarios that leave the ranks at different collectives (one rank done, one decoding; a group made on one
# rank only): a launch each; the others run in one launch together (error_worker.py)
ALONE = {"timeout_differs", "max_new_differs"}
_batches: dict = {}


def _by_scenario(procs) -> list[dict]:
    """Per rank: scenario -> its RESULT lines (error_worker prints SCENARIO before each)."""
    out = []
    for _, stdout, _ in procs:
        lines, scenario = {}, None
        for line in stdout.splitlines():
            if line.startswith("SCENARIO "):
                scenario = line[9:]
                lines[scenario] = []
            elif line.startswith("RESULT ") and scenario is not None:
                lines[scenario].append(line[7:])
        out.append(lines)
    return out


def _scenario_lines(scenario: str, request) -> tuple[list, list]:
    """(per rank: the scenario's RESULT lines, per rank: stderr), from its own launch or the session's batch."""
    if scenario in ALONE:
        procs = launch(2, [WORKER, scenario], timeout=300)
        return _results(procs), [err for _, _, err in procs]
    batch = tuple(
        item.callspec.params["scenario"]
        for item in request.session.items
        if getattr(item, "originalname", None) == request.node.originalname
        and item.callspec.params["scenario"] not in ALONE
    )
    if batch not in _batches:
        procs = launch(2, [WORKER, ",".join(batch)], timeout=900)
        _batches[batch] = (_by_scenario(procs), [err for _, _, err in procs])
    per_rank, errs = _batches[batch]
    return [lines.get(scenario, []) for lines in per_rank], errs


@pytest.mark.parametrize(
    "scenario,error,needle",
    [
        ("mismatch", "RankMismatchError", "different inputs"),
        ("mismatch_decode", "RankMismatchError", "different inputs"),  # the check under the decode step
        ("mask4d", "UnsupportedInputError", "2D padding mask"),
        ("labels", "UnsupportedInputError", "labels are not supported"),
        ("foreign_cache", "CacheMismatchError", "cannot be used under context parallelism"),
        ("batch_grows", "CacheMismatchError", "the cache holds 1 sequences but the input has 2"),
        ("batch_shrinks", "CacheMismatchError", "the cache holds 2 sequences but the input has 1"),
        ("after_remove", "PatchStateError", "works only with the patched model"),
        ("attn_changed", "PatchStateError", "changed after apply_context_parallel"),
        ("keep_differs", "RankMismatchError", "different inputs"),
        ("max_new_differs", "RankMismatchError", "different"),  # rank 0: different sequences, rank 1: inputs
        ("dropout", "UnsupportedModelError", "attention dropout is not supported"),
        ("deepcopy", "PatchStateError", "cannot be deep-copied"),
        ("timeout_differs", "RankMismatchError", "different timeout on different ranks"),
        ("partitions_differ", "RankMismatchError", "different partitions on different"),
        ("lookup_from_embeds", "CandidateDecodingError", "decoding from inputs_embeds are not supported"),
        ("lookup_from_embeds_unchecked", "CandidateDecodingError", "decoding from inputs_embeds are not supported"),
        ("zero_tokens", "UnsupportedInputError", "the input holds no tokens"),
        ("negative_keep", "UnsupportedInputError", "a negative int is not supported"),
        ("registered_diffllama", "UnsupportedModelError", "more than once per forward"),
        ("registered_jetmoe", "UnsupportedModelError", "other keys or values than a cache layer returned"),
        ("registered_gpt_neo", "UnsupportedModelError", "AttentionInterface"),
        ("registered_doge", "UnsupportedModelError", "score bias or mask of its own"),
        ("diffllama_ulysses", "HeadsNotDivisibleError", "expansion of its cached K/V over all its KV heads"),
        ("dsa_pass_q", "UnsupportedModelError", "strategy='ring_pass_q' (it moves queries between ranks)"),
        ("dsa_decode_pass_q", "UnsupportedModelError", "decode='ring_pass_q' (batched pass-Q decode moves"),
    ],
)
def test_bad_input_is_rejected_on_every_rank(scenario, error, needle, request):
    """Each refusal has its type (a subclass of ContextParallelError), on every rank."""
    assert issubclass(getattr(hf_contextpar, error), hf_contextpar.ContextParallelError)
    results, errs = _scenario_lines(scenario, request)
    for rank, lines in enumerate(results):
        assert lines and lines[-1].startswith(error + " ") and needle in lines[-1], (rank, lines, errs[rank][-2000:])


@pytest.mark.parametrize("scenario,code,limit", [("dies", 3, 15), ("stalls", 4, 30)])
def test_lost_rank_fails_the_others_within_the_timeout(scenario, code, limit):
    """A peer that exits, or stalls without exiting, makes rank 0 raise within the 8 s timeout."""
    procs = launch(2, [WORKER, scenario], timeout=300, env={"CP_TIMEOUT": "8"})
    assert procs[1][0] == code
    lines = _results(procs)[0]
    assert any(line.startswith("PeerFailureError ") for line in lines), procs[0][2][-2000:]
    elapsed = float(next(line for line in lines if line.startswith("elapsed")).split()[1])
    assert elapsed < limit


def test_bad_strategy():
    with pytest.raises(ValueError, match="strategy must be one of"):
        hf_contextpar.apply_context_parallel(tiny_model("llama"), strategy="bogus")
    with pytest.raises(ValueError, match="planner_rule must be one of"):  # at apply, not at the first forward
        hf_contextpar.apply_context_parallel(tiny_model("llama"), planner_rule="bogus")


def _from_config(model_type, **kw):
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw))


@pytest.mark.parametrize(
    "build,needle",
    [
        # a family refused whatever a user registers (patches.INEXACT), with the reason read from its code: CPM-Ant's
        # prefill attends both ways (the census's not-verified path: tests/test_census.py)
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
        # a layer kind the contract does not run, with the family's own reason (MiniMax-M3's block-sparse indexer)
        (
            lambda: AutoModelForCausalLM.from_config(tiny_config("minimax_m3_vl_text")),
            r"\['minimax_m3_sparse'\] layers \(its minimax_m3_sparse layers' lightning indexer",
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
        # no attention heads at all (RWKV's recurrence): refused at apply, not a crash in the cost model
        (
            lambda: _from_config(
                "rwkv",
                num_hidden_layers=2,
                hidden_size=64,
                attention_hidden_size=64,
                intermediate_size=64,
                vocab_size=64,
            ),
            "declares no attention heads",
        ),
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
    from hf_contextpar.models import tiny_config as tiny

    config = tiny("deepseek_v32")
    with pytest.raises(hf_contextpar.UnsupportedModelError, match=needle.replace("(", r"\(")):
        check_indexed(config, SimpleNamespace(strategy=strategy, decode=decode, sparse=sparse), dcp)
    for ok in ("auto", "ring_pass_kv", "allgather_kv", "kv_runahead"):
        assert check_indexed(config, SimpleNamespace(strategy=ok, decode="replicated", sparse=None), False)
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
