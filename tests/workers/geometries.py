"""Tiny models with the attention geometry of real checkpoints (issue 11).

Random tiny models (4 heads of 16) hide shape-dependent paths: many heads, wide heads (96,
128, 256), head_dim not dividing hidden_size, GQA ratios of 4 to 8, QKV bias, soft-capping,
per-layer-type RoPE. Each geometry keeps the checkpoint's heads, KV heads, head_dim, RoPE type
and parameters, sliding windows and layer pattern, and shrinks the rest: hidden size 64
(head_dim is read from the config, so the projections stay head-shaped), intermediate 128,
2 layers (Gemma-3: 6, for its 5 sliding : 1 full pattern), vocab 384 with the byte tokenizer's
ids. Windows and position thresholds are scaled down (`GEOMETRY_THRESHOLD`), so that short
prompts cross them.
"""

from __future__ import annotations

import copy

import torch
from hf_contextpar.patches import REGISTRY, SHARED_KV_GEMMA
from transformers import AutoConfig, AutoModelForCausalLM

_SMALL = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    initializer_range=0.2,
    tie_word_embeddings=False,
    bos_token_id=256,
    eos_token_id=257,
    pad_token_id=258,
)


def _longrope_factors(dim_half: int):
    """Phi-3-style per-frequency factors: ~1 for the fast frequencies, growing to ~40 for the slow ones."""
    short = [1.0 + 0.1 * i / (dim_half - 1) for i in range(dim_half)]
    long = [1.0 + 39.0 * (i / (dim_half - 1)) ** 2 for i in range(dim_half)]
    return short, long


_PHI3_SHORT, _PHI3_LONG = _longrope_factors(96 // 2)

# DeepSeek-V3's attention (below): its DSA successor V3.2 keeps it and adds the indexer
_DEEPSEEK_V3 = dict(
    model_type="deepseek_v3",
    num_attention_heads=16,
    num_key_value_heads=16,
    head_dim=64,
    first_k_dense_replace=2,
    initializer_range=0.05,
    max_position_embeddings=163840,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=40.0,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
        original_max_position_embeddings=4096,
    ),
)

GEOMETRIES: dict[str, dict] = {
    # 32 heads / 8 KV / 128, theta 5e5, llama3 scaling (a static frequency remap: no position threshold)
    "llama31_8b": dict(
        model_type="llama",
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
    # 28 / 4 / 128, QKV bias (always on in Qwen2), theta 1e6
    "qwen25_7b": dict(
        model_type="qwen2",
        num_attention_heads=28,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=32768,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    ),
    # the same with the YaRN x4 extension from 32768 (static frequencies and attention factor)
    "qwen25_7b_yarn": dict(
        model_type="qwen2",
        num_attention_heads=28,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=131072,
        rope_parameters=dict(
            rope_type="yarn", rope_theta=1000000.0, factor=4.0, original_max_position_embeddings=32768
        ),
    ),
    # 16 / 8 / 256, soft-capping 50 (attention) / 30 (final), window 4096 -> 32 alternating with full layers
    "gemma2_9b": dict(
        model_type="gemma2",
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        query_pre_attn_scalar=256,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        sliding_window=32,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=8192,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    ),
    # 8 / 4 / 256, 5 sliding (1024 -> 24) : 1 full; local theta 1e4, global theta 1e6 with linear x8
    "gemma3_4b": dict(
        model_type="gemma3_text",
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        query_pre_attn_scalar=256,
        num_hidden_layers=6,
        sliding_window=24,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        max_position_embeddings=131072,
        rope_parameters={
            "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
            "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1000000.0),
        },
    ),
    # 32 / 32 / 96, longrope with original 4096 -> 64 (max 131072 -> 2048 keeps the x32 ratio and its
    # attention factor). Phi3Config has no head_dim field and checks the longrope factors against
    # hidden_size / heads, so the config is built with the checkpoint's hidden size (3072) and shrunk
    # afterwards: the modeling code reads head_dim from the config. The checkpoint's window (262144) is never reached: 1024 here
    "phi3_mini_128k": dict(
        model_type="phi3",
        config_hidden_size=3072,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=96,
        max_position_embeddings=2048,
        original_max_position_embeddings=64,
        sliding_window=1024,
        rope_parameters=dict(
            rope_type="longrope",
            rope_theta=10000.0,
            short_factor=_PHI3_SHORT,
            long_factor=_PHI3_LONG,
            original_max_position_embeddings=64,
        ),
    ),
    # 32 / 8 / 128, theta 1e6, no sliding window (v0.3)
    "mistral_7b_v03": dict(
        model_type="mistral",
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        sliding_window=None,
        max_position_embeddings=32768,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    ),
    # 32 / 32 / 128, QK-norm over all heads, theta 5e5
    "olmo2_7b": dict(
        model_type="olmo2",
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=128,
        max_position_embeddings=4096,
        rope_parameters=dict(rope_type="default", rope_theta=500000.0),
    ),
    # gpt-oss-20b: 64 / 8 / 64, a learned sink per head, 128-token windows on alternate layers (scaled to 32),
    # YaRN x32 from 4096; MoE shrunk to 2 experts, both active (bf16 noise cannot flip a routing)
    "gpt_oss_20b": dict(
        model_type="gpt_oss",
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        sliding_window=32,
        layer_types=["sliding_attention", "full_attention"],
        num_local_experts=2,
        num_experts_per_tok=2,
        experts_implementation="eager",
        max_position_embeddings=131072,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            original_max_position_embeddings=4096,
        ),
    ),
    # DeepSeek-V3 / R1 / Kimi-K2: MLA with V3's latent ranks (q 1536, kv 512) and head sizes (128 + 64 RoPE
    # keys, 128 values), YaRN x40 with mscale; 16 heads of V3's 128 (each head is a 1536 x 192 slice of
    # q_b_proj); dense MLPs (V3's router is fp32)
    "deepseek_v3": _DEEPSEEK_V3,
    # DeepSeek-V3.2-Exp (685B): V3's MLA and YaRN (as above, 16 of its 128 heads) with DSA: the lightning indexer's 64
    # heads of 128 (the checkpoint's), its top-k 4 (the checkpoint's 2,048 of a 128K context is 1/64; these
    # prompts of 17-37 tokens keep 1/4 to 1/9 of their keys, so the selection cuts every shard)
    "deepseek_v32_685b": dict(
        _DEEPSEEK_V3,
        model_type="deepseek_v32",
        mlp_layer_types=["dense", "dense"],
        index_n_heads=64,
        index_head_dim=128,
        index_topk=4,
    ),
    # DeepSeek-V4-Flash: 64 query heads over one K=V head (MQA), RoPE on 1/8 of each head (64 of 512; here 8 of 64),
    # output in 8 groups; its lightning indexer's 64 heads of 128 (the checkpoint's), CSA entries of 4 tokens, HCA
    # entries of 128, a 128-token window (the checkpoint's: prompts of 133 and 261 tokens cut groups and windows
    # across every rank at N = 2-4), 4 hyper-connection streams; its top-k 512 of a 128K context's 32K CSA entries is
    # 1/64, here 8 of 261 tokens' 65 (1/8). Layers HCA then CSA, hash-routed MoE then routed (experts shrunk to 4)
    "deepseek_v4_flash": dict(
        model_type="deepseek_v4",
        num_attention_heads=64,
        num_key_value_heads=1,
        head_dim=64,
        q_lora_rank=32,
        o_groups=8,
        o_lora_rank=32,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=8,
        sliding_window=128,
        compress_rates=dict(compressed_sparse_attention=4, heavily_compressed_attention=128),
        hc_mult=4,
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe"],
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        experts_implementation="eager",
        initializer_range=0.05,
        max_position_embeddings=1048576,
        rope_parameters=dict(
            main=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.125),
            compress=dict(rope_type="default", rope_theta=160000.0, partial_rotary_factor=0.125),
        ),
    ),
    # Llama 4 Scout: 40 / 8 / 128, chunks of 8192 and temperature-tuning floor 8192 (both scaled to 32), NoPE
    # every 4th layer (here every 2nd), QK L2-norm, llama3 x16 scaling; dense MLPs (its router is fp32)
    "llama4_scout": dict(
        model_type="llama4_text",
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        attention_chunk_size=32,
        floor_scale=32,
        no_rope_layer_interval=2,
        intermediate_size_mlp=128,
        moe_layers=[],
        max_position_embeddings=131072,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=16.0,
            low_freq_factor=1.0,
            high_freq_factor=1.0,
            original_max_position_embeddings=8192,
        ),
    ),
    # Gemma 3n E2B: 8 / 2 / 256, 512-token windows (scaled to 24), the last layers reuse the K/V of an earlier
    # one of their kind (10 of 30; here 2 of 4), AltUp, LAuReL, per-layer inputs, activation sparsity.
    # Init 0.05: at 0.2 its 256-wide heads' fp32 rounding moved greedy logits by 1.4e-4 (fp64 exact)
    "gemma3n_e2b": dict(
        model_type="gemma3n_text",
        initializer_range=0.05,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        **SHARED_KV_GEMMA,
        activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0],
        laurel_rank=8,
    ),
    # Gemma 4: 8 / 4 heads of 256 on sliding layers (512 windows, scaled to 24) and of 512 on global ones
    # (proportional RoPE on a quarter of their dims), per-layer inputs; the last 2 of 4 layers share KV.
    # fp32: its family's bound (patches: the unpatched fp32 model is 1.3e-4 from fp64 at 53 tokens)
    "gemma4": dict(
        model_type="gemma4_text",
        num_attention_heads=8,
        num_key_value_heads=4,
        **SHARED_KV_GEMMA,
    ),
}

# The largest window or position threshold of each geometry that has one (scaled down):
# Gemma-2's window, Gemma-3's local window, Phi-3's longrope switch (original_max_position_embeddings),
# gpt-oss's window, Llama 4's chunk and temperature floor, Gemma 3n's and Gemma 4's windows.
GEOMETRY_THRESHOLD = {
    "deepseek_v32_685b": 16,  # not a threshold: lengths 17, 21, 37 and a greedy run from 12 tokens
    "deepseek_v4_flash": 128,  # its window and HCA's group (unscaled): lengths 17, 133, 261; greedy from 124 tokens
    "gemma2_9b": 32,
    "gemma3_4b": 24,
    "phi3_mini_128k": 64,
    "gpt_oss_20b": 32,
    "llama4_scout": 32,
    "gemma3n_e2b": 24,
    "gemma4": 24,
}


def geometry_config(name: str, **overrides):
    spec = copy.deepcopy({**_SMALL, **GEOMETRIES[name], **overrides})  # configs edit rope dicts in place
    hidden = spec["hidden_size"]
    spec["hidden_size"] = spec.pop("config_hidden_size", hidden)  # what the config's validation needs
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    config.hidden_size = hidden
    return config


def geometry_model(name: str, dtype=torch.float32, seed: int = 0, attn_implementation: str | None = None, **overrides):
    """A seeded random-initialised model with `name`'s attention geometry (same weights on every rank).
    Default attention: the family's reference implementation (patches.REGISTRY), else SDPA."""
    config = geometry_config(name, **overrides)
    if attn_implementation is None:  # the family's reference (eager for Gemma2's soft-capping, gpt-oss's sinks)
        family = REGISTRY.get(config.model_type)
        attn_implementation = family.reference_attn if family is not None else "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    return drawn_zero_init(model).eval()


@torch.no_grad()
def drawn_zero_init(model):
    """The model with DeepSeek-V4's position biases and sinks drawn (from the running seed): they start at zero,
    which would hide what they do (a group's softmax gates, a sink's weight)."""
    if model.config.model_type == "deepseek_v4":
        for name, p in model.named_parameters():
            if "position_bias" in name or name.endswith("sinks"):
                p.normal_(0, 1)
    return model


def geometry_model_type(name: str) -> str:
    return GEOMETRIES[name]["model_type"]
