"""Which model families hf-contextpar supports, and what each needs beyond the generic hook.

The generic hook is transformers' AttentionInterface + AttentionMaskInterface, a sharded cache and forward hooks
on the *ForCausalLM module; it covers every family below. This package fills the engine's family registry
(`hf_contextpar.model.families`: `FamilyPatch`, `REGISTRY`, `register`, `resolve`, re-exported here): a family
lists only what is particular to it, a `check(config)` that rejects configurations which would not be exact, an
optional `apply(model) -> undo` for a family that needs a reversible patch of its own, its `hooks` where it needs
of the engine what its config does not say (a `FamilyHooks` subclass: moshi.py, mamba1.py, qwen4_exp.py,
shared_kv.py), and the facts tests, eval and the CLI need (its tiny config, reference attention, fp64 tolerance). Adding a family is one entry here (plus
one file only if it needs a patch of its own); the engine never imports this package (the package face,
`hf_contextpar/__init__.py`, loads it). Installed as `hf_contextpar.patches`.

No opt-in for what is verified: `verified.py` is data the model census generates
(`python -m dev.census --from-json docs/census.json --verified patches/verified.py`), the
families it found exact at N = 2, 3 and 4 under every prefill strategy, both decode modes and a padded
batch, each with its fp64 tolerance and reference attention. They enter REGISTRY at import as plain
entries (`census=True`); an entry written here replaces a verified one, so this file holds only what is
particular to a family. Any other model_type is refused by `resolve` with what the census found and what
to do; `register()` is for a family a later transformers adds, once its user has verified it.
"""

from __future__ import annotations

from hf_contextpar.errors import UnsupportedModelError
from hf_contextpar.model import families
from hf_contextpar.model.families import REGISTRY, FamilyPatch, register, resolve  # noqa: F401 (the public names)
from hf_contextpar.model.families import add as _add

from . import (
    bamba,
    bloom,
    deepseek_v4,
    diffllama,
    doge,
    dory,
    falcon,
    gated_delta,
    gpt_neo,
    gpt_neox_japanese,
    hrm_text,
    inkling,
    inkling2,
    inkling2_loop,
    jetmoe,
    llama4_text,
    mamba1,
    minimax,
    minimax_m3,
    mllama,
    moshi,
    mpt,
    openai_gpt,
    opt,
    qwen4_exp,
    recurrent_gemma,
    rwkv,
    shared_kv,
    xglm,
    xlstm,
)
from .verified import CENSUS, NOT_VERIFIED, VERIFIED


def _text_only_gemma3(config):
    raise UnsupportedModelError(
        "Gemma3ForConditionalGeneration (model_type 'gemma3') mixes bidirectional image-token attention "
        "into the causal mask, which hf-contextpar does not shard. Load the text model with "
        "Gemma3ForCausalLM (model_type 'gemma3_text')."
    )


for _mt, (_tol, _attn) in VERIFIED.items():
    _add(
        FamilyPatch(_mt, f"{_mt}: verified by the model census", reference_attn=_attn, fp64_tolerance=_tol, census=True)
    )

# what is particular to a family (a check, a tolerance, a patch, the exactness matrix's tiny config)
# Gemma 3n / 4's layer pattern, shrunk: sliding and global layers alternate, the last 2 of 4 reuse the K/V of
# the earlier layer of their kind, per-layer inputs (the tiny models and tests/workers/geometries.py share it)
SHARED_KV_GEMMA = dict(
    num_hidden_layers=4,
    num_kv_shared_layers=2,
    layer_types=["sliding_attention", "full_attention"] * 2,
    sliding_window=24,
    vocab_size_per_layer_input=384,
    hidden_size_per_layer_input=16,
)

DSA_TINY = dict(
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=64,
    first_k_dense_replace=2,
    mlp_layer_types=["dense", "dense"],  # dense MLPs: the MoE router runs in fp32 even in an fp64 model
    initializer_range=0.05,
    index_topk=16,
    index_n_heads=1,
    index_head_dim=128,
)
DSA_FAMILIES = [
    FamilyPatch(
        "deepseek_v32",
        "DeepSeek-V3.2: MLA with DeepSeek Sparse Attention (a lightning indexer's top-k)",
        indexed=True,
        tiny=DSA_TINY,
    ),
    FamilyPatch(  # its second layer reuses the first one's top-k ("shared")
        "glm_moe_dsa",
        "GLM-5: MLA with DSA, interleaved RoPE in the indexer, layers sharing an earlier layer's top-k",
        indexed=True,
        tiny=dict(DSA_TINY, indexer_types=["full", "shared"]),
    ),
    # the exactness matrix runs the two above (its time is capped); A.X K2's indexer is DeepSeek-V3.2's, run by the
    # census and its sweeps at N = 2, 3, 4 (its MoE router's fp32: the census's bound)
    FamilyPatch("axk2", "A.X K2: MLA with DSA, gated queries", indexed=True, fp64_tolerance=1e-5),
    # dots.llm3 Note's text model: DSA layers beside sliding-window MLA layers, attention sizes per layer
    FamilyPatch("dots3_note_text", "dots.llm3 Note (text): MLA with DSA, sliding MLA layers", indexed=True),
    # hyper-connections: hidden states (B, T, hc_mult, H), gathered by their token dim counted from the front
    # (outputs.py); transformers runs its sinks in eager attention only
    FamilyPatch(
        "hy_v4",
        "Hunyuan-V4: MLA with DSA, attention sinks and hyper-connections, layers sharing an earlier layer's top-k",
        indexed=True,
        reference_attn="eager",
        fp64_tolerance=1e-5,
    ),
    # Qwen4-Exp's QSA: a block indexer that hands its top blocks as the indexer's mask narrowed (patches/qwen4_exp.py)
    # and keeps the whole sequence's position ids on its first indexed cache layer (indexed.History),
    # beside Gated DeltaNet layers whose states pass down the ranks
    FamilyPatch(
        "qwen4_exp_text",
        "Qwen4-Exp (text): QSA block-indexed attention beside Gated DeltaNet layers, hyper-connections, MoE",
        indexed=True,
        recurrent=True,
        apply=gated_delta.apply,
        hooks=qwen4_exp.HOOKS,
        fp32_tolerance=2e-3,
    ),
    # MiniMax-M3's block indexer: its top key blocks per KV head as block_indices (patches/minimax_m3.py); its MoE
    # router's fp32 (the census's bound: ours 1e-14 with the model's internals in fp64, N = 2, 3, 4)
    FamilyPatch(
        "minimax_m3_vl_text",
        "MiniMax-M3 (text): block-sparse attention layers (a lightning indexer's top key blocks), MoE",
        indexed=True,
        hooks=minimax_m3.HOOKS,
        fp64_tolerance=1e-5,
        csa=False,  # its sparse layers keep the indexer's blocks, not CSA's pruning (check_indexed refuses it too)
    ),
]

_ALIBI_PORT = dict(reference_attn="eager", fp64_tolerance=1e-4, csa=False)  # BLOOM's and MPT's entries alike

for _patch in [
    FamilyPatch("llama", "Llama 2/3/3.x: GQA, RoPE", tiny={}),
    FamilyPatch("mistral", "Mistral: GQA, sliding window on every layer", tiny=dict(sliding_window=24)),
    FamilyPatch(
        "qwen2",
        "Qwen2/2.5: GQA, QKV bias, optional sliding layers",
        tiny=dict(
            use_sliding_window=True,
            sliding_window=24,
            max_window_layers=1,
            layer_types=["full_attention", "sliding_attention"],
        ),
    ),
    FamilyPatch("qwen3", "Qwen3: GQA, QK-norm", tiny={}),
    # HF runs Gemma2's soft-capping only in eager attention, whose softmax is fp32 even for fp64 models
    FamilyPatch(
        "gemma2",
        "Gemma2: alternating sliding/global layers, attention and final logit soft-capping",
        tiny=dict(
            sliding_window=24,
            attn_logit_softcapping=20.0,
            final_logit_softcapping=15.0,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention"],
        ),
        reference_attn="eager",
        fp64_tolerance=1e-5,
    ),
    FamilyPatch(
        "gemma3_text",
        "Gemma3 (text): alternating sliding/global layers, QK-norm, dual RoPE",
        tiny=dict(sliding_window=24, query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"]),
    ),
    FamilyPatch("phi3", "Phi-3: fused QKV, sliding window", tiny=dict(sliding_window=40, num_key_value_heads=4)),
    FamilyPatch("olmo2", "OLMo 2: QK-norm, post-norm blocks", tiny={}),
    # transformers runs gpt-oss's sinks in eager attention only (no sdpa); its MoE's grouped matmul has no
    # fp64 CPU kernel, so the tiny model's experts run eagerly
    FamilyPatch(
        "gpt_oss",
        "gpt-oss: attention sinks, alternating sliding/global layers, MoE",
        tiny=dict(
            num_local_experts=2,  # both experts for every token: bf16 noise cannot flip the routing
            num_experts_per_tok=2,
            sliding_window=24,
            layer_types=["sliding_attention", "full_attention"],
            experts_implementation="eager",
        ),
        reference_attn="eager",
    ),
    # Llama 4's attention (chunked layers, NoPE layers with temperature tuning), scaled down so that chunks
    # (8192 in Scout and Maverick) and the tuning's floor (8192) cut a short prompt. Dense MLPs: its MoE
    # router's sigmoid runs in fp32 even in an fp64 model (1e-7 from the row count of its matmul alone)
    FamilyPatch(
        "llama4_text",
        "Llama 4 (text): chunked attention, NoPE layers with attention temperature tuning, QK L2-norm",
        apply=llama4_text.apply,
        tiny=dict(
            attention_chunk_size=16, no_rope_layer_interval=2, floor_scale=16, intermediate_size_mlp=128, moe_layers=[]
        ),
    ),
    # Gemma 3n (E2B / E4B): the last layers reuse the K/V an earlier layer of their kind stored (10 of 30 in
    # E2B), AltUp, LAuReL, per-layer inputs, activation sparsity on the first layers
    FamilyPatch(
        "gemma3n_text",
        "Gemma 3n (text): KV shared across layers, alternating sliding/global layers, AltUp, per-layer inputs",
        tiny=dict(**SHARED_KV_GEMMA, activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0], laurel_rank=8),
        hooks=shared_kv.HOOKS,
    ),
    # Gemma 4: sliding and global layers of different head sizes (256 and 512 in the checkpoints), proportional
    # RoPE on the global ones, per-layer inputs; the last 2 of 4 layers reuse the K/V of an earlier one. Its
    # unpatched fp32 forward is 1.2e-4 (tiny, 120 tokens) to 1.3e-4 (geometry, 53 tokens) from the same
    # weights in fp64: twice that is its fp32 bound. Init 0.05: at 0.2 swapping the kernel alone moves bf16
    # logits by 1.24 (scale 6.6); at 0.05 by 0.56
    FamilyPatch(
        "gemma4_text",
        "Gemma 4 (text): per-layer head sizes, KV shared across layers, alternating sliding/global layers",
        fp32_tolerance=3e-4,
        tiny=dict(**SHARED_KV_GEMMA, initializer_range=0.05),
        hooks=shared_kv.HOOKS,
    ),
    # Gemma 4 Unified's text model: Gemma 4's layers (its fp32 bound, KV shared across layers when the config shares
    # some); bidirectional attention over image tokens alone (use_bidirectional_attention="vision"): text is causal
    FamilyPatch(
        "gemma4_unified_text",
        "Gemma 4 Unified (text): per-layer head sizes, KV shared across layers, alternating sliding/global layers",
        fp32_tolerance=3e-4,
        hooks=shared_kv.HOOKS,
    ),
    # OPT numbers tokens by its attention mask (a left-padded row starts at 0): its positions are computed from the
    # whole mask before the inputs are sharded
    FamilyPatch("opt", "OPT: learned absolute positions read off the attention mask", apply=opt.apply),
    # Llama 3.2 Vision's text model: a cross-attention layer every fifth layer, skipped by a text-only forward as one
    # process skips it; vision inputs refused (patches/mllama.py)
    FamilyPatch(
        "mllama_text_model",
        "Mllama (Llama 3.2 Vision, text): self-attention layers, cross-attention layers skipped text-only",
        apply=mllama.apply,
    ),
    # a layer that calls its attention otherwise, given one call with its cache layer's K/V (patches/<family>.py):
    # JetMoE tiles its K/V to its top_k x Hkv query heads (the query heads go into GQA order instead), DiffLlama
    # attends twice, on two halves of V (once over both side by side, expanded per block: Ulysses refused), HRM
    # runs each stack layer's attention once per cycle, each in its cache slot (the slot as its layer_idx)
    # (CSA's pruning and one-process reference are not defined for them, nor for Moshi's windowless sliding layers)
    FamilyPatch("jetmoe", "JetMoE: a mixture of attention heads over shared K/V", apply=jetmoe.apply, csa=False),
    FamilyPatch("diffllama", "DiffLlama: one call over both value halves", apply=diffllama.apply, csa=False),
    # HRM's cycles repeat every layer: its unpatched fp32 model is 1.4e-4 to 2.6e-4 from fp64 (census config, 6 prompts)
    FamilyPatch("hrm_text", "HRM (text): H/L cycles", apply=hrm_text.apply, csa=False, fp32_tolerance=5e-4),
    # families whose attention transformers keeps hand-written, ported to its AttentionInterface (patches/ported.py)
    # (reference_attn: the implementation transformers runs them with; GPT-Neo's, GPT-NeoX-Japanese's and XGLM's classes
    # take "eager" alone, Falcon's SDPA too)
    FamilyPatch(
        "xglm", "XGLM: sinusoidal positions, a hand-written attention ported", apply=xglm.apply, reference_attn="eager"
    ),
    FamilyPatch(
        "gpt_neo",
        "GPT-Neo: alternating global and local (windowed) layers, a hand-written attention ported",
        apply=gpt_neo.apply,
        reference_attn="eager",
        fp64_tolerance=1e-4,  # its scores are fp32 even in an fp64 model (the census measures the bound)
    ),
    FamilyPatch(
        "gpt_neox_japanese",
        "GPT-NeoX-Japanese: fused QKV, partial RoPE, a hand-written attention ported",
        apply=gpt_neox_japanese.apply,
        reference_attn="eager",
    ),
    FamilyPatch(
        "falcon",
        "Falcon: multi-query or grouped K/V, RoPE or ALiBi, a hand-written attention ported",
        check=falcon.check,
        apply=falcon.apply,
    ),
    # ALiBi as a score bias from global columns (patches/alibi.py); their softmax runs in fp32 even in an fp64 model
    # (the census measures the bound); CSA prunes blocks by unbiased scores: refused
    *(
        FamilyPatch(mt, f"{name}: ALiBi, a hand-written attention ported", apply=port, **_ALIBI_PORT)
        for mt, name, port in (("bloom", "BLOOM", bloom.apply), ("mpt", "MPT", mpt.apply))
    ),
    # a per-key bias from each key's values (patches/doge.py), computed for every block as it arrives; its tiny census
    # model's A is zero (a constant bias softmax ignores): tests/*/test_score_bias.py runs it with A ~ N(0, 1)
    FamilyPatch("doge", "Doge: a dynamic per-key bias from the values", apply=doge.apply, csa=False),
    # no KV cache: every forward is a prefill; its -1e4 causal fill reads as -inf for every real token's row
    FamilyPatch(
        "openai-gpt",
        "OpenAI GPT: no KV cache, a hand-written attention ported",
        apply=openai_gpt.apply,
        reference_attn="eager",
        csa=False,
    ),
    # Moshi's decoder masks full causal while DynamicCache(config) keeps sliding layers of config.sliding_window (3000)
    FamilyPatch("moshi", "Moshi (text): full causal over sliding cache layers", hooks=moshi.HOOKS, csa=False),
    # DeepSeek-V3's attention geometry (its config's defaults): q/kv latent ranks 1536/512, 128 + 64 RoPE key
    # dims, 128 value dims. Dense MLPs only: its MoE router runs in fp32 even in an fp64 model. At the usual
    # tiny init range (0.2) the 1536-wide query latent makes scores so large that swapping the attention
    # kernel alone moves fp32 logits by 1e-3; at 0.05, 4e-6
    # DeepSeek Sparse Attention (DSA) on DeepSeek-V3's tiny MLA geometry (the config's latent ranks), with the
    # checkpoints' indexer head (128 numbers, RoPE on 64) and half as many indexer heads as attention heads (64 of
    # 128 in DeepSeek-V3.2, 32 of 64 in GLM-5): one, whose ReLU'd scores tie at 0 wherever its dot product is
    # negative, so the top-k's order among equal scores is exercised. Top-16: the matrix's 97- and 301-token
    # prompts select, its 1- to 9-token ones have k above the context
    *DSA_FAMILIES,
    # DeepSeek-V4: its compressors' unfinished group passes down the chain and their entries go to every rank in its
    # cache layers, its attention merges them after the window's (patches/deepseek_v4.py, attention/entries.py)
    FamilyPatch(
        "deepseek_v4",
        "DeepSeek-V4: sliding K=V MQA with compressed (CSA, HCA) entries, an indexer's top-k, sinks, hyper-connections",
        apply=deepseek_v4.apply,
        compressed=True,
        csa=False,
        reference_attn="eager",
    ),
    FamilyPatch(
        "deepseek_v3",
        "DeepSeek-V3 / R1, Kimi-K2: multi-head latent attention (the cache holds the latent, never per-head K/V)",
        tiny=dict(
            num_attention_heads=2, num_key_value_heads=2, head_dim=64, first_k_dense_replace=2, initializer_range=0.05
        ),
    ),
]:
    _add(_patch)
# Hybrids: recurrent layers (linear attention, state-space, short convolutions) beside attention. Their mixers read
# and write their states only through transformers' cache API and continue a multi-token forward from a cached
# state, so the states pass down the ranks in the cache (recurrent.py); tests/multi_process/test_hybrid.py checks each against
# one process at N = 2, 3, 4 (fp64 with the models' fp32 internals in fp64). Not here: MiniMax keeps its
# lightning attention's state in a cache class of its own
# fp32: the unpatched fp32 model's own distance from fp64 (tests/workers/hybrids.py's models, 200 tokens, one row padded),
# doubled: Gated DeltaNet's chunked scan 1.8e-4 to 9.1e-4, KDA / OLMo-hybrid / Zamba2 4.7e-5 to 7.7e-5, the rest
# below 2.3e-5 (the default bound holds). Splitting a scan at other points moves fp32 logits by as much
for _mt, _what, _fp32 in [
    ("qwen3_next", "Qwen3-Next: Gated DeltaNet layers beside gated attention, MoE", 2e-3),
    ("qwen3_5_text", "Qwen3.5 (text): Gated DeltaNet layers beside gated attention", 2e-3),
    ("qwen3_5_moe_text", "Qwen3.5-MoE (text): Gated DeltaNet layers beside gated attention, MoE", 2e-3),
    ("lara_mini", "LaraMini: linear-attention layers beside sliding-window attention", 2e-3),
    ("granitemoehybrid", "Granite 4.0-H: Mamba2 layers beside attention, MoE", 1e-4),
    ("nemotron_h", "Nemotron-H: Mamba2, MLP and attention layers", 1e-4),
    ("falcon_h1", "Falcon-H1: attention and Mamba2 side by side in every layer", 1e-4),
    ("zamba2", "Zamba2: Mamba2 layers and a shared attention block", 2e-4),
    ("mamba2", "Mamba2: state-space layers alone", 1e-4),
    ("lfm2", "LFM2: short-convolution layers beside attention", 1e-4),
    ("lfm2_moe", "LFM2-MoE: short-convolution layers beside attention, MoE", 1e-4),
    ("lfm3", "LFM3: short-convolution layers beside attention", 1e-4),
    ("kimi_linear", "Kimi-Linear: KDA layers beside latent (MLA) attention", 2e-4),
    ("olmo_hybrid", "OLMo-hybrid: Gated DeltaNet layers beside attention", 2e-4),
    ("bailing_hybrid", "Bailing-hybrid (Ling 2.5): KDA-style linear-attention layers beside attention, MoE", 1e-4),
    ("zaya", "ZAYA: CCA attention (its convolved queries and keys and delayed values carried in the cache), MoE", 1e-4),
]:
    # gated_delta: a Gated DeltaNet mixer's chained rank waits for the passed state at its scan (no-op elsewhere)
    _add(FamilyPatch(_mt, _what, recurrent=True, apply=gated_delta.apply, fp32_tolerance=_fp32))
# why a family's layers of a kind the contract does not run are refused (the kind named by the refusal, this after it)
NOT_CHAINED = families.NOT_CHAINED
# Inkling: short convolutions on K, V and around attention and MLP (chained), and a relative bias per query token
# (patches/inkling.py: a score bias from global columns that stays with the queries; pass-Q and Ulysses refused)
_add(
    FamilyPatch(
        "inkling_text",
        "Inkling (text): short convolutions, a relative-position bias per query token, sliding layers",
        apply=inkling.apply,
        recurrent=True,
        csa=False,
    )
)
# Inkling 2: Inkling's, with per-token sinks and attention residuals over depth (patches/inkling2.py)
_add(
    FamilyPatch(
        "inkling2_text",
        "Inkling 2 (text): short convolutions, a relative bias and sinks per query token, residuals over depth",
        apply=inkling2.apply,
        recurrent=True,
        csa=False,
        reference_attn="eager",  # its per-token sinks: no SDPA
    )
)
# Inkling 2 Loop: Inkling 2's, with a section of layers run loop_num_passes times, each pass after the first through
# copies of the section's cache layers, made up front (patches/inkling2_loop.py)
_add(
    FamilyPatch(
        "inkling2_loop_text",
        "Inkling 2 Loop (text): Inkling 2's layers, a section of them looped, one cache copy per pass",
        apply=inkling2_loop.apply,
        recurrent=True,
        csa=False,
        reference_attn="eager",  # its per-token sinks: no SDPA
        hooks=inkling2_loop.HOOKS,
    )
)
# Mamba1's scan starts every multi-token forward from zero: patches/mamba1.py adds the passed state's share
_add(FamilyPatch("jamba", "Jamba: Mamba1 layers beside attention, MoE", apply=mamba1.apply, recurrent=True))
# Zamba scans its Mamba1 channels per head, from one (batch, heads, head_dim, state) state (patches/mamba1.py)
_add(
    FamilyPatch(
        "zamba",
        "Zamba: Mamba1 layers (per-head scans) and a shared attention block",
        apply=mamba1.apply,
        recurrent=True,
    )
)
for _mt, _what in [("mamba", "Mamba: Mamba1 layers alone"), ("falcon_mamba", "Falcon-Mamba: Mamba1 layers alone")]:
    _add(FamilyPatch(_mt, _what, apply=mamba1.apply, recurrent=True, hooks=mamba1.MASKED_INPUT))
# MiniMax keeps its lightning states in a cache class of its own (patches/minimax.py: through the state API)
_add(
    FamilyPatch(
        "minimax", "MiniMax: lightning-attention layers beside attention, MoE", apply=minimax.apply, recurrent=True
    )
)
# RecurrentGemma keeps its RG-LRU and convolution states on its modules: patches/recurrent_gemma.py runs them through
# the cache's state API, so the chain passes them; its RG-LRU accumulates in fp32 even in an fp64 model
_add(
    FamilyPatch(
        "recurrent_gemma",
        "RecurrentGemma (Griffin): RG-LRU and short-convolution blocks beside local (sliding-window) attention",
        apply=recurrent_gemma.apply,
        recurrent=True,
    )
)
# RWKV keeps its states in a list of its own (`state=`) and has no attention: patches/rwkv.py runs its blocks through
# a cache of one two-state layer each (its hooks' `cache`), so the chain passes them, and returns them in `state`
_add(
    FamilyPatch(
        "rwkv",
        "RWKV (v4): time-mix (WKV) and channel-mix recurrences, no attention",
        apply=rwkv.apply,
        recurrent=True,
        hooks=rwkv.HOOKS,
        csa=False,
    )
)
# Dory's recurrent loops each write a copy of the section's cache layers, made up front (patches/dory.py)
_add(
    FamilyPatch(
        "dory",
        "Dory: a recurrent section of layers looped n_recurrent_loops times, one cache copy per loop",
        check=dory.check,
        hooks=dory.HOOKS,
        csa=False,  # its looped layers attend through cache copies, which CSA's pruning and reference do not define
    )
)
# xLSTM keeps its mLSTM states in xLSTMCache, outside the Cache API: patches/xlstm.py runs its blocks through
# transformers' layers (its hooks' cache), each token with the kernel one process runs it with; no attention
# layer for CSA to prune
_add(
    FamilyPatch(
        "xlstm",
        "xLSTM: mLSTM blocks (matrix memory, normalizer and max state per layer)",
        check=xlstm.check,
        apply=xlstm.apply,
        recurrent=True,
        hooks=xlstm.HOOKS,
        csa=False,
    )
)
# Bamba numbers a forward's positions from 0 when given none, even over a cache (patches/bamba.py)
_add(FamilyPatch("bamba", "Bamba: Mamba2 layers beside attention", apply=bamba.apply, recurrent=True))
_add(FamilyPatch("gemma3", "Gemma3 multimodal (rejected: use Gemma3ForCausalLM)", check=_text_only_gemma3))


# families whose attention hf-contextpar cannot serve exactly whatever the weights: refused even when registered (a
# user's register() replaces an entry, so a check in one would not hold)
INEXACT = families.INEXACT
INEXACT |= {
    # CpmAntModel._prepare_attention_mask: `context` is all ones, so its mask is `context[:, None, :] | ...`, True
    # everywhere but the left padding (token id 0): in a prefill every token attends to the later ones too
    "cpmant": (
        "CpmAntModel.forward masks its prefill bidirectionally (its `context` is all ones: each token attends to later "
        "ones too; only the left padding it finds from token id 0 is masked), and hf-contextpar's algorithms are "
        "causal (or sliding-window causal) only; run it on one process"
    ),
    # found by the census on its own tests' config (patching off, fixed-length patches). modeling_blt's BltModel pools
    # bytes into patches by cross-attention (boundaries from patch_lengths or its entropy patcher over the whole
    # sequence), runs its global transformer over them with no cache and positions from 0 in every forward, and its
    # local decoder writes its self-attention K/V into the cross-attention cache: one process's cached decode is not
    # its recompute (census config, fp64: logits 3.9 apart, 7 of 8 tokens other; its integration tests use_cache=False)
    "blt": (
        "its global transformer attends over patches pooled from the bytes, with no cache and positions from 0 in "
        "every forward: a rank's bytes would form patches without the earlier ranks', and its own cached decode is "
        "not its recompute (use_cache=False). Run it on one process"
    ),
}
# a drafter for Gemma 4's assisted decoding, not a causal LM of its own (modeling_gemma4_assistant.py): its forward
# ignores input_ids and raises without the target's inputs_embeds and shared_kv_states, its layers attend over the
# target's K/V with bidirectional masks and use_cache=False (every layer KV-shared by default: num_kv_shared_layers =
# num_hidden_layers where unset)
_DRAFTER = (
    "it is Gemma 4's draft model for assisted decoding, not a causal LM of its own: its forward ignores input_ids and "
    "attends over the target model's shared_kv_states, with no sequence or cache of its own to shard. Run it on one "
    "process"
)
INEXACT |= {"gemma4_assistant": _DRAFTER, "gemma4_unified_assistant": _DRAFTER}


families.CENSUS.update(transformers=CENSUS["transformers"], not_verified=NOT_VERIFIED)
families.seal()
