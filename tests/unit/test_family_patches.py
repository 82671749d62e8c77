"""The family patches that rewrite how a layer calls its attention (patches/jetmoe.py, hrm_text.py, diffllama.py, the
ported hand-written attentions of xglm.py, gpt_neo.py, gpt_neox_japanese.py and falcon.py) or what it takes (mllama.py), on one
process with transformers' own attention: the patched model computes what the unpatched one does (the multi-process
census and its sweeps check them under context parallelism), and what a patch refuses it refuses."""

from __future__ import annotations

import inspect

import pytest
import torch
from hf_contextpar.patches import (
    bloom,
    diffllama,
    falcon,
    gpt_neo,
    gpt_neox_japanese,
    hrm_text,
    jetmoe,
    mllama,
    mpt,
    openai_gpt,
    xglm,
)
from transformers import AutoConfig, AutoModelForCausalLM

from hf_contextpar.errors import UnsupportedInputError, UnsupportedModelError
from hf_contextpar.model.contract import attention_layers

_SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=64, vocab_size=256)
CONFIGS = {
    # 3 experts of 2 KV heads per token: query head k * Hkv + j attends with KV head j (tiled, not GQA's order)
    "jetmoe": dict(
        _SMALL, num_attention_heads=6, num_key_value_heads=2, kv_channels=16, num_local_experts=4, num_experts_per_tok=3
    ),
    # 4 KV heads: the two value halves are heads (0, 1) and (2, 3), each repeated twice
    "diffllama": dict(_SMALL, num_attention_heads=8, num_key_value_heads=4, head_dim=16),
    "hrm_text": dict(_SMALL, num_attention_heads=4, head_dim=16, H_cycles=2, L_cycles=2),
}
PATCHES = {"jetmoe": jetmoe.apply, "hrm_text": hrm_text.apply, "diffllama": diffllama.apply}


def _model(family, attn):
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **CONFIGS[family])
    config._attn_implementation = attn
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()


def _unpatched_patched_undone(model, apply, while_patched=lambda: None):
    """A padded batch's logits and 4 greedy tokens before a family patch, under it, and the logits after its undo:
    (mask, ref, ref_tokens, ours, tokens, back)."""
    ids = torch.randint(1, 256, (2, 23), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # a left-padded row
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        ref_tokens = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        undo = apply(model)
        while_patched()
        ours = model(ids, attention_mask=mask).logits
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        undo()
        back = model(ids, attention_mask=mask).logits
    return mask, ref, ref_tokens, ours, tokens, back


# JetMoE's patch sets GQA's group size, which eager and SDPA read; HRM's only renumbers the layer's cache slot
@pytest.mark.parametrize(
    "family, attn", [("jetmoe", "eager"), ("jetmoe", "sdpa"), ("hrm_text", "sdpa"), ("diffllama", "sdpa")]
)
def test_a_patched_layer_computes_what_the_model_does(family, attn):
    mask, ref, ref_tokens, ours, tokens, back = _unpatched_patched_undone(_model(family, attn), PATCHES[family])
    # eager attention gives the pad rows of a left-padded row NaN, on both sides
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12, equal_nan=True)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(back, ref, rtol=0, atol=0, equal_nan=True)


def test_hrm_refuses_a_prefix_block():
    model = _model("hrm_text", "sdpa")
    ids = torch.randint(1, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    undo = hrm_text.apply(model)
    with torch.no_grad():
        model(ids, token_type_ids=torch.zeros_like(ids))  # no block: causal, as ours
        with pytest.raises(UnsupportedInputError, match="bidirectional prefix block"):
            model(ids, token_type_ids=torch.ones_like(ids))
        names = list(inspect.signature(type(model).forward).parameters)[1:]
        by_position = [torch.ones_like(ids) if n == "token_type_ids" else None for n in names]
        with pytest.raises(UnsupportedInputError, match="bidirectional prefix block"):
            model(ids, *by_position[1 : names.index("token_type_ids") + 1])
    undo()


# the families whose hand-written attention patches/ported.py ports to the AttentionInterface: the port's eager path
# is the model's own arithmetic (XGLM's unpatched model fails in fp64: its mask clamp is an fp32 constant)
PORTED = {
    "xglm": (xglm.apply, torch.float32, dict(num_layers=2, d_model=64, ffn_dim=64, attention_heads=4)),
    # a window shorter than the prompt on the local layer
    "gpt_neo": (
        gpt_neo.apply,
        torch.float64,
        dict(num_layers=2, hidden_size=64, num_heads=4, attention_types=[[["global", "local"], 1]], window_size=7),
    ),
    # partial RoPE, the last layer's output bias
    "gpt_neox_japanese": (
        gpt_neox_japanese.apply,
        torch.float64,
        dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_multiple_size=1),
    ),
    # multi-query (Falcon-7B's geometry: one K/V head)
    "falcon": (falcon.apply, torch.float64, dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4)),
    # ALiBi (patches/alibi.py): under transformers' attention the model's own forward, under hf-contextpar's the bias
    # from global columns (tests/*/test_score_bias.py runs them under context parallelism)
    "bloom": (bloom.apply, torch.float64, dict(n_layer=2, hidden_size=64, n_head=4)),
    "mpt": (mpt.apply, torch.float64, dict(n_layers=2, d_model=64, n_heads=4)),
    # no KV cache (its port stores K/V in the forward's own cache under context parallelism)
    "openai-gpt": (openai_gpt.apply, torch.float64, dict(n_layer=2, n_embd=64, n_head=4)),
}


@pytest.mark.parametrize("family", sorted(PORTED))
def test_a_ported_attention_computes_what_the_model_does(family):
    apply, dtype, sizes = PORTED[family]
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, vocab_size=256, **sizes)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    assert not model._can_set_attn_implementation()
    switchable = []  # what lets hf-contextpar switch its attention in, while patched
    mask, ref, ref_tokens, ours, tokens, back = _unpatched_patched_undone(
        model, apply, lambda: switchable.append(model._can_set_attn_implementation())
    )
    assert switchable == [True] and not model._can_set_attn_implementation()
    rows = mask.bool()
    # BLOOM's fp64 eager run gives a left-padded row NaN throughout (its fp64 mask minimum is -inf in its fp32
    # softmax, a pad query's row all -inf), on both sides
    close = dict(rtol=0, equal_nan=True)
    torch.testing.assert_close(ours[rows], ref[rows], atol=1e-6 if dtype == torch.float32 else 1e-12, **close)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(back[rows], ref[rows], atol=0, **close)


def test_falcon_refuses_alibi_under_eager_attention_only():
    """Falcon's eager path adds ALiBi twice (scores and mask): 0.05 from its SDPA path, which hf-contextpar computes."""
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    logits = {}
    for impl in ("eager", "sdpa"):
        torch.manual_seed(0)
        config = AutoConfig.for_model(
            "falcon", alibi=True, num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256
        )
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float64, attn_implementation=impl).eval()
        with torch.no_grad():
            logits[impl] = model(ids).logits
        if impl == "eager":
            with pytest.raises(UnsupportedModelError, match="ALiBi"):
                falcon.check(model.config)
        else:
            falcon.check(model.config)
    assert (logits["eager"] - logits["sdpa"]).abs().max() > 1e-3  # the reason for the refusal holds
    falcon.check(AutoConfig.for_model("falcon"))  # RoPE: no refusal


def _mllama():
    """Llama 3.2 Vision's text model, with its cross-attention layer (layer 1 of 3; the checkpoints' every fifth)."""
    torch.manual_seed(0)
    text = dict(num_hidden_layers=3, cross_attention_layers=[1], hidden_size=64, intermediate_size=64)
    config = AutoConfig.for_model("mllama", text_config=dict(text, num_attention_heads=4, num_key_value_heads=2))
    config.text_config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()


def test_mllama_runs_text_only_and_refuses_vision_inputs():
    """The patch leaves a text-only forward as it is (its cross-attention layer skipped, as the model skips it), the
    coverage check counts the self-attention layers alone, and vision states are refused before any collective."""
    model = _mllama()
    assert [type(layer).__name__ for layer in model.model.layers][1] == "MllamaCrossAttentionDecoderLayer"
    assert attention_layers(model.config) == 2  # what ran hf-contextpar's attention in a text-only forward
    mask, ref, ref_tokens, ours, tokens, back = _unpatched_patched_undone(model, mllama.apply)
    rows = mask.bool()
    torch.testing.assert_close(ours[rows], ref[rows], rtol=0, atol=0)
    assert torch.equal(tokens, ref_tokens)
    ids = torch.randint(1, 256, (1, 9), generator=torch.Generator().manual_seed(3))
    undo = mllama.apply(model)
    with torch.no_grad(), pytest.raises(UnsupportedInputError, match="cross_attention_states given"):
        model(ids, cross_attention_states=torch.zeros(1, 4, 64, dtype=torch.float64))
    undo()


def test_a_port_keeps_a_forward_replaced_on_the_instance():
    """A module whose forward a user (or a hook) replaced on the instance keeps it: the port would drop that code
    unseen (the fuzz drew Inkling 2 with its last layer calling SDPA itself: ported over, the patch was gone and the
    model ran unrefused); kept, the coverage check refuses the forward, naming the layer. The other modules are
    ported, and undo restores all."""
    torch.manual_seed(0)
    config = AutoConfig.for_model("bloom", vocab_size=256, n_layer=2, hidden_size=64, n_head=4)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()
    first, last = [m for m in model.modules() if type(m).__name__ == "BloomAttention"]
    users = last.forward = lambda *args, **kwargs: None  # a user's own forward
    undo = bloom.apply(model)
    assert last.forward is users and first.forward.__func__ is bloom._forward
    undo()
    assert last.forward is users and "forward" not in first.__dict__
