"""Tiny hybrid models (recurrent layers beside attention) for the chain's tests: per family, a random
model with its realistic layer mix (3 recurrent layers to 1 attention layer where the config takes a
pattern), small states, and scans chunked inside every partition. fp64 runs use the census's
`Fp64Internals`, so the models' deliberate fp32 internals (chunked scans, gates) run in fp64 too."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the census (dev/) is a checkout's, not installed
from hf_contextpar.patches import REGISTRY  # noqa: E402

from dev.census.configs import _known, tiny_config  # noqa: E402

GDN = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_value_head_dim=16, linear_key_head_dim=16)
SIZES = {  # smaller states than the census's tiny configs (those take 10-20 s a forward), chunks of 16
    "qwen3_next": GDN,
    "qwen3_5_text": GDN,
    "qwen3_5_moe_text": GDN,
    "granitemoehybrid": dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16),
    "nemotron_h": dict(mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=16),
    "mamba2": dict(num_heads=8, head_dim=16, state_size=16, chunk_size=16),
    "zamba2": dict(mamba_d_state=16, chunk_size=16),
    "bamba": dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16),
    "falcon_h1": dict(mamba_d_state=16, mamba_chunk_size=16),
    "kimi_linear": dict(linear_num_heads=4, linear_head_dim=16),
    "minimax": dict(block_size=4),  # lightning attention's blocks cut inside every partition
    # chunks of 4 and one-process pieces of 12 tokens (max_inference_chunksize), both cut inside partitions
    # (its xLSTMCache sizes its states by hidden_size * factor rounded up to 64: the census's sizes keep them whole)
    "xlstm": dict(hidden_size=128, num_heads=2, qk_dim_factor=0.5, chunk_size=4, max_inference_chunksize=12),
}
MIX = ["linear_attention"] * 3 + ["full_attention"]
LAYOUT = {  # the layer pattern, in each config's own terms (None: the tiny config's)
    "qwen3_next": dict(layer_types=MIX),
    "qwen3_5_text": dict(layer_types=MIX),
    "qwen3_5_moe_text": dict(layer_types=MIX),
    "lara_mini": dict(layer_types=MIX[:3] + ["sliding_attention"], sliding_window=8),  # a window inside partitions
    "granitemoehybrid": dict(layer_types=MIX),
    "nemotron_h": dict(layer_types=MIX),
    "kimi_linear": dict(layer_types=MIX),
    "olmo_hybrid": dict(layer_types=MIX),
    "lfm2": dict(layer_types=["conv"] * 3 + ["full_attention"]),
    "lfm2_moe": dict(layer_types=["conv"] * 3 + ["full_attention"]),
    "lfm3": dict(layer_types=["conv"] * 3 + ["full_attention"]),
    "bamba": dict(attn_layer_indices=[3]),
    "falcon_h1": None,  # every layer runs attention and Mamba2 side by side
    # Mamba2 layers and shared attention blocks (layer_idx -1): two hybrid layers, so a block's second call is met
    "zamba2": dict(layer_types=["linear_attention", "hybrid"] * 2, hybrid_layer_ids=[1, 3]),
    "mamba2": None,  # recurrent layers alone
    "jamba": None,  # Mamba1 layers beside attention, MoE (patches/mamba1.py: its scan continued from the state)
    # lightning attention (patches/minimax.py: its own cache class's state); attention first: one process reads the
    # cache's length from layer 0, which MiniMaxCache leaves empty when it is a lightning layer (a later turn fails)
    "minimax": dict(layer_types=MIX[::-1]),
    # RG-LRU and short-convolution blocks beside local attention (patches/recurrent_gemma.py: the states through the
    # cache); its conv keeps 3 inputs, more than the second turn's partitions at N = 4 hold (9 tokens over 4 ranks)
    "recurrent_gemma": dict(block_types=["recurrent"] * 3 + ["attention"], sliding_window=8),
    # short convolutions on K, V, the attention output and the MLP (conv states 2, 3 written after the attention), a
    # relative bias per query (patches/inkling.py); its convs keep 3 inputs, more than N = 4's second-turn partitions
    "inkling_text": dict(
        layer_types=["hybrid_sliding"] * 3 + ["hybrid"], mlp_layer_types=["dense", "sparse"] * 2, sliding_window=8
    ),
    # Inkling's, with sinks per query token and attention residuals over depth (patches/inkling2.py), blocks of 2
    "inkling2_text": dict(
        layer_types=["hybrid_sliding"] * 3 + ["hybrid"],
        sliding_window=8,
        n_layers_per_attn_res_block=2,
        unpadded_vocab_size=384,  # its embedding's rows: the byte tokenizer's vocabulary (BYTE_IDS)
    ),
    # Inkling 2's, with layers 1-2 (a sliding and a full one) looped: 2 more passes, each through cache copies of
    # theirs (patches/inkling2_loop.py), messages from the pass before; every layer a residual block
    "inkling2_loop_text": dict(
        layer_types=["hybrid_sliding", "hybrid_sliding", "hybrid", "hybrid_sliding"],
        sliding_window=8,
        n_layers_per_attn_res_block=1,
        loop_layer_index_start=1,
        loop_layer_index_end=3,
        loop_num_passes=3,
        loop_gate_rank=8,
        unpadded_vocab_size=384,
    ),
    "mamba": None,  # Mamba1 layers alone; the model multiplies its input by the raw mask (patches/mamba1.py MaskedInput)
    "falcon_mamba": None,
    "xlstm": None,  # mLSTM blocks alone, their states in xLSTMCache (patches/xlstm.py: through the cache's layers)
}
FAMILIES = list(LAYOUT)
# recurrent models whose states are a list of their own (`state=`), outside the Cache API, and no attention
# (patches/rwkv.py), with their config's overrides: their own cases (tests/workers/hybrid_worker.py `check_state_list`)
STATE_LIST = {"rwkv": dict(rescale_every=1)}  # hidden states halved after every block (checkpoints: every 6th)
# the families whose bias or sinks are computed per query token (held with the queries): strategies that move
# queries (pass-Q, Ulysses) are refused with an UnsupportedModelError at the first forward
PER_QUERY = {"inkling_text", "inkling2_text", "inkling2_loop_text"}
GIVEN_CACHE = {"recurrent_gemma"}  # returns no cache (its states are its modules'): the caller passes one and keeps it
# one process does not reorder its states with the beams (patches/minimax.py, patches/recurrent_gemma.py)
BEAMS_REFUSED = {"minimax", "recurrent_gemma", "xlstm"}  # xLSTM: transformers refuses beams on one process too
# generate() over a cache passed back: one process's fails over xLSTMCache (no is_compileable), or, where it runs,
# feeds the whole history again on top of the state (patches/xlstm.py refuses it; a forward over the cache runs)
CACHED_GENERATE_REFUSED = {"xlstm"}


BYTE_IDS = dict(vocab_size=384, bos_token_id=256, eos_token_id=257, pad_token_id=258)  # the byte tokenizer's ids
# registered families with no tiny config of their registry entry, verified by the census: exact through a family
# patch (patches/: deepseek_v4.py, diffllama.py, hrm_text.py, jetmoe.py, bloom.py and mpt.py's ALiBi, doge.py's per-key
# bias; Dory's per-loop cache copies, dory.py; Moshi's cache_window; the hand-written attentions ported: falcon.py,
# gpt_neo.py's local layers, gpt_neox_japanese.py, openai_gpt.py, xglm.py; mllama.py's cross-attention layer, skipped
# text-only), DSA-indexed (axk2, hy_v4, qwen4_exp_text; minimax_m3_vl_text's block indexer), hybrids (bailing_hybrid,
# zamba, zaya), dots3_note_text and gemma4_unified_text (bidirectional over images only: causal text). The fuzz draws
# them with the census's tiny configs, and the variants of CENSUS_VARIANTS.
CENSUS_CONFIGS = [
    "axk2",
    "bailing_hybrid",
    "bloom",
    "deepseek_v4",
    "diffllama",
    "doge",
    "dory",
    "dots3_note_text",
    "falcon",
    "falcon_rw",
    "gemma4_unified_text",
    "gemma4_unified_shared_kv",
    "gpt_neo",
    "gpt_neox_japanese",
    "hrm_text",
    "hy_v4",
    "jetmoe",
    "minimax_m3_vl_text",
    "mllama",
    "moshi",
    "mpt",
    "openai-gpt",
    "qwen4_exp_text",
    "xglm",
    "zamba",
    "zaya",
]
# a census family in another configuration its checkpoints use: (family, overrides of the census's tiny config)
CENSUS_VARIANTS = {
    # Falcon-RW: ALiBi instead of RoPE, one K/V head per head, attention then MLP, biases (the census's Falcon: RoPE)
    # Gemma 4 Unified's last layers reusing an earlier layer's K/V (patches/shared_kv.py; its config's default shares none)
    "gemma4_unified_shared_kv": (
        "gemma4_unified_text",
        dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2),
    ),
    "falcon_rw": (
        "falcon",
        dict(alibi=True, new_decoder_architecture=False, multi_query=False, parallel_attn=False, bias=True),
    ),
}
CENSUS_CHAINED = ["bailing_hybrid", "deepseek_v4", "qwen4_exp_text", "zamba", "zaya"]  # of those, the chained ones
# (recurrent layers; DeepSeek-V4's compressors' unfinished groups)


def census_family_config(family: str):
    """The census's tiny config of `family` (the one it verified, or a variant of it) with the byte tokenizer's ids."""
    family, overrides = CENSUS_VARIANTS.get(family, (family, {}))
    config = tiny_config(family, **overrides)
    text = config.get_text_config(decoder=True)
    for key, value in BYTE_IDS.items():
        setattr(text, key, value)
    return config


def hybrid_config(family: str):
    config = tiny_config(family)
    kw = {**_known(config), **SIZES.get(family, {})}
    kw.update(BYTE_IDS)
    layout = LAYOUT[family] if family in LAYOUT else STATE_LIST[family]
    if layout is None:
        keys = ("hybrid_layer_ids", "layers_block_type", "attn_layer_period", "attn_layer_offset")
        pattern = {
            k: v for k, v in config.to_dict().items() if k in keys + ("expert_layer_period", "expert_layer_offset")
        }
        kw.update(pattern)
    else:
        n = len(layout.get("layer_types", [])) or 4
        kw.update(layout, num_hidden_layers=n)
    config = AutoConfig.for_model(family, **kw)
    if not hasattr(config, "use_cache"):  # Inkling's has none: a forward keeps no cache unless asked (generate asks)
        config.use_cache = True
    return config


def hybrid_model(family: str, dtype=torch.float64, seed: int = 0):
    config = hybrid_config(family)
    torch.manual_seed(seed)
    impl = REGISTRY[family].reference_attn if family in REGISTRY else "sdpa"  # Inkling 2's sinks: eager alone
    attn = {} if getattr(config, "num_attention_heads", None) is None else {"attn_implementation": impl}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation="eager", **attn).eval()
