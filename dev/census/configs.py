"""What the model census (`dev.census`) runs: the model types in scope and a tiny config each.

`scope()` reads transformers' own `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` and drops, with the reason, the
causal-LM heads that are not decoder-only text models: halves of encoder-decoder models (the type is
also a seq2seq, speech-seq2seq or text-to-waveform model), encoder-only models (it has a masked-LM or
multiple-choice head), multimodal wrappers (its causal-LM class is its multimodal class), and the two
that no mapping marks (`EXCLUDED`). `tiny_config` gives every family the keys of `GENERIC` its config
knows, then the family's line of `OVERRIDES`, where the generic keys do not fit.
"""

from __future__ import annotations

import torch

SIZES = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
TOKENS = dict(vocab_size=256, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1)
MOE_SIZES = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, n_group=1, topk_group=1)
MLA_SIZES = dict(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
# each key is passed where the family's config has it (a property it computes is left to it)
GENERIC = dict(
    **SIZES, head_dim=16, **TOKENS, initializer_range=0.2, tie_word_embeddings=False, first_k_dense_replace=1
)
GENERIC.update(**MOE, **MOE_SIZES, **MLA_SIZES)
# multi-head latent attention (a config with kv_lora_rank): these keys take the value of those
MLA = dict(head_dim="qk_rope_head_dim", num_key_value_heads="num_attention_heads")
# DSA's indexer (index_head_dim at least the RoPE part's 8), keeping 16 keys of the 61-token prompt: the selection bites
DSA = dict(index_n_heads=2, index_head_dim=16, index_topk=16)
QSA = dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=32, indexer_compress_ratio=4)
DOTS3_MLA = dict(MLA_SIZES, num_attention_heads=4, num_key_value_heads=4, head_dim=16)
MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=32)
ROPE = dict(rope_type="default", rope_theta=1e4)
DBRX_FFN = dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2)
PERIOD_2 = dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1)
# Gemma 3n / 4 text: 4 layers, sliding and global alternating, the last 2 reusing the K/V of the earlier layer of
# their kind (the default 2-layer config shares nothing), a window shorter than the census's 61-token prompt
SHARED_KV = dict(
    num_hidden_layers=4,
    num_kv_shared_layers=2,
    layer_types=["sliding_attention", "full_attention"] * 2,
    sliding_window=24,
)
# a window or chunk the config sets (thousands of tokens by default) shrunk to bite on the census's 61-token prompt,
# so that its sliding / chunked layers drop tokens in prefill, decode and the second turn (a config without one keeps
# none: a window is not added where the family has none)
WINDOWS = dict(sliding_window=24, attention_chunk_size=16)
MAX_PARAMS = 20e6  # a "tiny" config above this needs an override (two fp64 copies per rank)

# where the generic keys do not fit: family -> config overrides (a dict value updates a sub-config). Two
# keys are not config: "_reference", the unpatched attention implementation exactness is measured against
# (soft-capping runs in eager only), and "_fp64_tolerance", that reference's fp64 limit (eager's fp32 softmax)
OVERRIDES: dict[str, dict] = {
    "axk2": DSA,
    "bailing_hybrid": dict(num_experts=4, num_expert_group=1, num_experts_per_token=2, linear_num_heads=4),
    "bamba": dict(attn_layer_indices=[1], **MAMBA),
    # its own tests' config: patching off (fixed-length patches), num_hidden_layers set on the top config (its cache
    # reads it), the global transformer twice as wide as the local encoder / decoder (hidden_size_global)
    "blt": dict(
        encoder_hash_byte_group_vocab=256,
        encoder_hash_byte_group_size=[2, 3],
        num_hidden_layers=2,
        patch_in_forward=False,
        global_config=dict(hidden_size=128, head_dim=32),
        decoder_config=dict(hidden_size_global=128),
    ),
    "codegen": dict(rotary_dim=8),
    "cohere_compass_text": dict(rope_parameters=dict(full_attention=ROPE, sliding_attention=ROPE)),
    "dbrx": dict(d_model=64, attn_config=dict(rope_theta=1e4, clip_qkv=8.0), ffn_config=DBRX_FFN),
    # one input, two recurrent (looped twice: its default, each loop after the first through a cache copy) and one
    # output layer: the generic 2 layers with its default 8 + 8 input and output layers ran both layers twice,
    # updating each cache layer twice (an artefact of the config). Its checkpoints' loop holds sliding and full layers
    # (every fourth full): the loop here one of each
    "dory": dict(
        num_hidden_layers=4,
        n_input_layers=1,
        n_recurrent_layers=2,
        n_output_layers=1,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    ),
    # its attention sizes are per layer (per_layer_config: the DSA layer's and the sliding MLA layer's), which the
    # generic keys do not reach (49M parameters): MLA_SIZES on both layers, a window shorter than the prompt
    "dots3_note_text": dict(
        DSA, **DOTS3_MLA, shared_experts_intermediate_size=32, sliding_window=24, per_layer_config={1: DOTS3_MLA}
    ),
    "deepseek_v32": DSA,
    # every mechanism bites on the 61-token prompt: the window, HCA's entries (every 8 tokens, not 128), CSA's top-k
    # (4 of up to 15 entries; its indexer at DSA's sizes); the grouped output projection at a tiny rank
    "deepseek_v4": dict(
        DSA,
        index_topk=4,
        sliding_window=24,
        compress_rates=dict(compressed_sparse_attention=4, heavily_compressed_attention=8),
        o_lora_rank=16,
        o_groups=2,
    ),
    # the multimodal config of the same causal LM (its text model): the adapters' widths match the tiny sizes
    "dots3_note": dict(
        text_config=dict(
            DSA, **DOTS3_MLA, shared_experts_intermediate_size=32, sliding_window=24, per_layer_config={1: DOTS3_MLA}
        ),
        vision_config=dict(adapter_in_dim=64, adapter_out_dim=64),
        audio_config=dict(adapter_input_size=64, adapter_out_dim=64),
    ),
    "gemma3n_text": dict(
        **SHARED_KV,
        intermediate_size=64,
        activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
        vocab_size_per_layer_input=256,
        hidden_size_per_layer_input=16,
    ),
    "gemma4_assistant": dict(text_config=dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)),
    "gemma4_text": dict(**SHARED_KV, vocab_size_per_layer_input=256, hidden_size_per_layer_input=16),
    "glm_moe_dsa": DSA,
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=24),
    "gptj": dict(rotary_dim=8),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"], **MAMBA),
    # its two layer kinds (the config's every sixth layer full, the rest sliding), a dense and a sparse MLP; the relative
    # bias's extent and the log scaling's floor within the 61-token prompt, so both bite inside the partitions
    "inkling_text": dict(
        layer_types=["hybrid_sliding", "hybrid"],
        mlp_layer_types=["dense", "sparse"],
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=16,
        rel_extent=20,
        log_scaling_n_floor=8,
    ),
    # Inkling 2's geometry (below), its loop inside the layers: layers 1-2 (sliding, full) run 3 passes, one cache copy
    # of theirs per pass after the first (the config's defaults loop layers 6-17 of 24, past the tiny config's layers)
    "inkling2_loop_text": dict(
        num_hidden_layers=4,
        layer_types=["hybrid_sliding", "hybrid_sliding", "hybrid", "hybrid_sliding"],
        unpadded_vocab_size=256,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=16,
        rel_extent=20,
        log_scaling_n_floor=8,
        n_layers_per_attn_res_block=1,
        loop_layer_index_start=1,
        loop_layer_index_end=3,
        loop_num_passes=3,
        loop_gate_rank=8,
    ),
    # Inkling's geometry (above), with its per-token sinks; attention residual blocks of one layer (every layer a block boundary)
    "inkling2_text": dict(
        unpadded_vocab_size=256,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=16,
        rel_extent=20,
        log_scaling_n_floor=8,
        n_layers_per_attn_res_block=1,
    ),
    "jamba": dict(**PERIOD_2, mamba_dt_rank=8),
    # its three layer kinds (the default 34 layers hold all three), a window shorter than the 61-token prompt
    "lara_mini": dict(
        num_hidden_layers=3, layer_types=["linear_attention", "sliding_attention", "full_attention"], sliding_window=24
    ),
    "kimi_linear": dict(linear_num_heads=4, linear_head_dim=16),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    # its three layer kinds (the default 24 layers hold all three), a window shorter than the 61-token prompt
    "lfm3": dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "sliding_attention"], sliding_window=24),
    "longcat_flash": dict(expert_ffn_hidden_size=32, ffn_hidden_size=64, zero_expert_num=2, moe_topk=2),
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=1),
    # its attention is full causal over what its cache layers hold, sliding windows of sliding_window (3000): a
    # window shorter than the prompt, so that decode and the second turn attend over a cache that has dropped tokens
    # Llama 3.2 Vision's text model: a cross-attention layer among self-attention layers (its default config puts
    # one every fifth layer), skipped by a text-only forward as one process skips it
    "mllama": dict(text_config=dict(num_hidden_layers=3, cross_attention_layers=[1])),
    "moshi": dict(sliding_window=24),
    # MiniMax-M3's text model: a block-sparse (lightning indexer) layer beside a full one, blocks of 8 keys, the top 3
    # of up to 8 kept: the selection bites on the 61-token prompt
    "minimax_m3_vl_text": dict(
        layer_types=["full_attention", "minimax_m3_sparse"],
        index_n_heads=2,
        index_head_dim=16,
        index_block_size=8,
        index_topk_blocks=3,
    ),
    # its default pattern: a Mamba2, an MoE, an attention and an MLP block
    "nemotron_h": dict(
        layers_block_type=["linear_attention", "moe", "full_attention", "mlp"], mamba_num_heads=8, mamba_head_dim=16
    ),
    "qwen4_exp": dict(text_config=QSA),
    "qwen4_exp_text": QSA,
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
    # its hidden states halved after every block, as the checkpoints' every 6th (rescale_every=6 over 12 to 32 layers)
    "rwkv": dict(rescale_every=1),
    "vaultgemma": {"_reference": "eager", "_fp64_tolerance": 1e-5},
    # its own tests' sizes and native kernels (the default Triton kernels need a GPU)
    "xlstm": dict(
        hidden_size=128,
        num_heads=2,
        qk_dim_factor=0.5,
        v_dim_factor=1.0,
        chunkwise_kernel="chunkwise--native_autograd",
        sequence_kernel="native_sequence__native",
        step_kernel="native",
    ),
    "zaya": dict(num_experts_per_tok=1),
}
# causal-LM heads of models that no mapping marks as encoder or seq2seq, dropped with their reason
EXCLUDED = {
    "bert-generation": "encoder-only: BertGeneration, the encoder/decoder blocks of EncoderDecoderModel",
    "trocr": "encoder-decoder half: TrOCR's decoder, the text half of VisionEncoderDecoderModel",
}


def scope() -> tuple[list[str], dict[str, str]]:
    """(the census's model types, {dropped model type: reason}), both from transformers' mappings."""
    from transformers.models.auto import modeling_auto as ma

    causal = ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    seq2seq = {
        **ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        **ma.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
        **ma.MODEL_FOR_TEXT_TO_WAVEFORM_MAPPING_NAMES,
    }
    encoders = {**ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES, **ma.MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES}
    multimodal = {**ma.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES, **ma.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES}
    families, dropped = [], {}
    for mt, cls in causal.items():
        if mt in seq2seq:
            dropped[mt] = "encoder-decoder half: the decoder of a seq2seq / speech / text-to-audio model"
        elif mt in encoders:
            dropped[mt] = (
                "encoder-only: has a masked-LM / multiple-choice head (a bidirectional encoder run as a decoder)"
            )
        elif cls.endswith("ForConditionalGeneration") or multimodal.get(mt) == cls:
            dropped[mt] = f"multimodal wrapper: {cls} is the model's multimodal class (text+image/audio inputs)"
        elif mt in EXCLUDED:
            dropped[mt] = EXCLUDED[mt]
        else:
            families.append(mt)
    return sorted(families), dict(sorted(dropped.items()))


def _has(config, key: str) -> bool:
    try:  # a per-layer attribute (a heterogeneous config) refuses a global read: not a generic key there
        return hasattr(config, key)
    except Exception:
        return False


def _known(config) -> dict:
    """GENERIC's keys that `config` has (multi-head latent attention: head_dim is the RoPE part, as many KV
    heads as query heads), its windows shrunk (WINDOWS), per-layer lists cut to two layers (the first layer's entry and the first other
    one), sub-configs alike."""
    read_only = {k for k in GENERIC if isinstance(getattr(type(config), k, None), property)}
    kwargs = {k: v for k, v in GENERIC.items() if _has(config, k) and k not in read_only}
    for key, small in WINDOWS.items():
        value = getattr(config, key, None) if _has(config, key) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > small:
            kwargs[key] = small
    if "kv_lora_rank" in kwargs:
        kwargs.update({k: kwargs[v] for k, v in MLA.items() if k in kwargs and v in kwargs})
    layers = getattr(config, "num_hidden_layers", None) if _has(config, "num_hidden_layers") else None
    for key, value in config.to_dict().items():
        if isinstance(value, list) and isinstance(layers, int) and len(value) == layers > 2:
            if key in kwargs:  # a generic size given per layer
                kwargs[key] = [kwargs[key]] * 2
            else:
                kwargs[key] = [value[0], next((v for v in value if v != value[0]), value[1])]
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            kwargs[key] = _known(sub)
    return kwargs


def tiny_config(model_type: str, **extra):
    """The family's tiny config: GENERIC where its config (or its text config) knows the key, then OVERRIDES, then
    `extra` (another configuration of the family: the tests' variants)."""
    from transformers import AutoConfig

    overrides = {k: v for k, v in OVERRIDES.get(model_type, {}).items() if not k.startswith("_")}
    try:
        default = AutoConfig.for_model(model_type, **overrides)
    except Exception:  # overrides that need the small sizes
        default = AutoConfig.for_model(model_type)
    kwargs = _known(default)
    for key, value in {**overrides, **extra}.items():
        kwargs[key] = {**kwargs.get(key, {}), **value} if isinstance(value, dict) else value
    return AutoConfig.for_model(model_type, **kwargs)


def build(model_type: str, dtype, attn: str):
    """The family's tiny model, seeded (the same weights on every rank); attn "default": transformers' choice."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    kw = {} if attn == "default" else dict(attn_implementation=attn)
    kw["experts_implementation"] = "eager"  # the grouped-mm kernel has no fp64
    return AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=dtype, **kw).eval()
