"""One rank of the seeded differential fuzz test (issue 10): random cases against the unpatched model.

Run it on N processes (torchrun, or tests/launch.py); every failure prints the command that
reproduces it, e.g.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 3 tests/workers/fuzz_worker.py --seed 0 --case 17

Case k of seed s on N ranks is drawn from random.Random(f"{s}/{N}/{k}") alone, so it is the same
case whether it runs in a long loop or by itself. A case draws a family (the registered ones, a
few opted in through `hf_contextpar.patches.register`, the families exact through a family patch that the census
verifies (tests/workers/hybrids.py CENSUS_CONFIGS, on the census's tiny configs), the hybrids and RWKV (their
realistic layer mixes, tests/workers/hybrids.py; RWKV's states a list it takes back as `state=`), and the real-checkpoint geometries of tests/workers/geometries.py), dtype, RoPE type, strategy, decode mode and KV interleave, batch size,
padding, prompt lengths, 1 to 3 turns and a generation mode per turn, the cache copied between turns (deep
copy, pickle, torch.save) and user code around the model (a custom attention function, a layer calling SDPA
itself, register() of the family: refused by type, or exact). Rank 0 runs the unpatched model (the
single-process reference: nothing distributed touches it) and broadcasts its results; every
rank then runs the patched model and compares each turn (logits within tolerance, tokens
identical), and digests of every rank's outputs are compared (identical on every rank).

One case in five runs the approximate mode, `sparse=CSA(...)` (issue 41, `draw_csa`): keep-all is compared
with the unpatched model; a pruning one with CSA's one-process reference (eval/csa_reference.py: rank 0 runs
the unpatched model inside it), fp64, within CSA_TOL. A layer kind CSA does not define, or a topology that
does not hold N ranks, must be refused at apply (UnsupportedModelError, ValueError).

Keeping the ranks in step: rank 0 alone decides whether another case starts (the time budget)
and broadcasts it; every case runs on a fresh process group (`apply_context_parallel(...,
timeout=60)` makes one), so a rank that raised mid-collective leaves its peers a 60 s timeout
and no stray message in later cases; per-case exceptions are caught on every rank and the
outcomes are exchanged on the default group. After ranks raised differently (one rank failed
while its peers waited), the launch stops: the peers' state is no longer trustworthy.

Padding kinds and what is compared:
- "none" (mask None or all ones), "left" (generate's usual), "right" (transformers warns but
  runs it), "holes" (zeros inside the mask), "all_pad_row" (one row is all padding, the others
  left-padded), "packed" (batch 1, no mask, position_ids restarting at 0: packed sequences,
  which transformers turns into a block-diagonal mask; forward only).
- A case may feed inputs_embeds instead of input_ids (forward turns, and generate as the only turn,
  there with or without the prompt's input_ids beside them).
- Forward turns return a ModelOutput or a tuple (return_dict=False, as an argument or on the
  config), the logits logits_to_keep asks for, and, when output_hidden_states is drawn, every
  layer's hidden states (compared at every valid position, relative to the reference's magnitude).
- Logits are compared at real (unmasked) positions where the reference is finite. A query with
  no visible key gets a kernel-specific output (HF's eager softmax averages every key, SDPA may
  give NaN): an all-padding row, or a row whose last prompt position is padding with no real key
  within a sliding window (right padding, holes). Generation continues from that query, so such
  a row, and the rows generated from it, are skipped for logits and tokens; they must still be
  identical on every rank.
- fp32 greedy-like modes: a token divergence where the reference's top-2 margin is within twice
  the tolerance and every earlier logit matched is a near-tie, not a failure (the case stops).
- Where the reference's own logits are NaN (HF's fp64 eager Gemma2 computes its softmax in fp32
  and NaNs on padded queries; 0 x NaN then reaches real rows, and beam search stops early), its
  tokens mean nothing: a token difference in such a row is "reference_nan", not a failure.
- A reference that raises truncates the case before that turn, and the patched model must raise at
  that turn too, the first turn included (one process refusing an input that N processes answer is
  a silent wrong answer), unless the reference sampled from NaN probabilities (kernel-specific values,
  above); a case with no comparable turn and no such refusal is "skipped".
Expected errors (the documented contract, counted as passes), matched by type (hf_contextpar.errors),
never by message: Ulysses when N does not divide the query or KV heads (HeadsNotDivisibleError at
apply), a sliding window of 1 (UnsupportedModelError at apply), decode="ring_pass_q" with fewer
sequences than ranks (DecodeBatchError; conversely a decode that runs anyway is a failure), packed
sequences (PackedSequenceError), assisted / prompt-lookup decoding over a cache an earlier turn
filled (transformers feeds the whole sequence again on top of the cache there; CacheMismatchError,
as for Phi-3's dropped caller cache), assisted / prompt-lookup decoding from inputs_embeds (with or
without input_ids; transformers drafts from input_ids and crops the mask to them:
CandidateDecodingError), a
negative int logits_to_keep (UnsupportedInputError: Gemma 4 slices by it twice), and RWKV's (`listed_refuses`:
padding, beams, a one-token step of several rows with a state).
Tolerances, the near-tie rule and the digests are the exactness oracle's (hf_contextpar.eval.oracle).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import functools
import inspect
import io
import json
import math
import os
import pickle
import random
import sys
import time
import traceback
import types
import warnings

import torch
import torch.distributed as dist
from geometries import GEOMETRIES, drawn_zero_init, geometry_config  # noqa: E402
from hf_contextpar.eval.csa_reference import csa_reference  # noqa: E402
from hf_contextpar.eval.oracle import (  # noqa: E402
    FLOAT_TOL,
    Fp64Internals,  # noqa: E402
    logit_tolerance,
    near_tie,
    top2_margin,
)
from hf_contextpar.eval.oracle import digest as tensors_digest  # noqa: E402
from hf_contextpar.patches import REGISTRY, FamilyPatch, register  # noqa: E402
from hf_contextpar.patches.mamba1 import MaskedInput  # noqa: E402
from hf_contextpar.patches.verified import VERIFIED  # noqa: E402
from hybrids import (
    BEAMS_REFUSED,  # noqa: E402
    CACHED_GENERATE_REFUSED,  # noqa: E402
    CENSUS_CHAINED,  # noqa: E402
    CENSUS_CONFIGS,  # noqa: E402
    CENSUS_VARIANTS,  # noqa: E402
    GIVEN_CACHE,  # noqa: E402
    PER_QUERY,  # noqa: E402
    STATE_LIST,  # noqa: E402
    census_family_config,  # noqa: E402
    hybrid_config,  # noqa: E402
)
from hybrids import FAMILIES as HYBRIDS  # noqa: E402
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, Cache, DynamicCache
from transformers.utils import logging as hf_logging
from user_patches import call_sdpa_itself  # noqa: E402

import hf_contextpar  # noqa: E402
from hf_contextpar.cache.sharded import cache_aliases, cache_argument  # noqa: E402
from hf_contextpar.model.contract import has_sinks  # noqa: E402
from hf_contextpar.models import TINY_BASE, tiny_config  # noqa: E402
from hf_contextpar.plan.strategies import prefill_names  # noqa: E402
from hf_contextpar.sparse import CSA  # noqa: E402
from hf_contextpar.sparse.csa import refuse_layers as refuse_csa_layers  # noqa: E402

REGISTERED = [mt for mt, p in REGISTRY.items() if p.tiny is not None]
# recurrent families whose states are a list of their own, passed back as `state=` (RWKV's): drawn with the hybrids
LISTED = sorted(STATE_LIST)
_BASE = TINY_BASE
# Families outside the registry that a user could opt in (plain causal softmax attention), each
# with what sets it apart: Granite's attention/logit multipliers, StarCoder2's biases, LayerNorm
# and sliding window, SmolLM3's NoPE layers, StableLM's partial rotary and per-head LayerNorm.
OPTED_IN = {
    "granite": dict(
        model_type="granite",
        embedding_multiplier=2.0,
        attention_multiplier=0.1,
        residual_multiplier=0.5,
        logits_scaling=4.0,
    ),
    "starcoder2": dict(model_type="starcoder2", sliding_window=24, use_bias=True),
    "smollm3": dict(model_type="smollm3", no_rope_layers=[1, 0]),
    "stablelm": dict(
        model_type="stablelm",
        num_key_value_heads=4,
        qk_layernorm=True,
        use_qkv_bias=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
    ),
}
# families one process cannot run in fp64: XGLM's attention clamps its scores at torch.full((), finfo(float64).min),
# made in the default dtype (float32), which overflows (RuntimeError); its port computes what it would, so the fp64
# reference raising would make the fuzz ask the patched model to raise
FP32_ONLY = {"xglm"}
STRATEGIES = [*prefill_names(), "auto"]
DECODES = ["auto", "replicated", "ring_pass_q"]
KV_INTERLEAVES = [1, 1, 2, 3, 16]  # decode tokens per rank in a run (apply_context_parallel(kv_interleave=k))
# a family's sliding window as configured (None), or narrower than any shard: a window of 2-3 tokens
# (needle-lm's layer 0 sees 2) reaches at most the previous rank's last tokens; a window of 1 must be
# refused (UnsupportedModelError at apply: transformers' own cached decode differs from a recompute)
WINDOWS = [None, None, None, 1, 2, 3]
# how decode's gathers travel: shared memory (the default on one host) or gloo (shared memory closed)
TRANSPORTS = ["shm", "shm", "gloo"]
ROPES = ["default", "linear", "dynamic", "yarn", "llama3", "longrope"]
PADDINGS = ["none", "left", "right", "holes", "all_pad_row", "packed"]
PAD_ID = 258
CASE_TIMEOUT_S = 60  # the per-case process group's timeout: a peer that raised costs this much
# CSA (issue 41, the one approximate mode): a share of the cases run `sparse=CSA(...)` instead, drawn from a
# stream of their own, so the other draws of a seed stay as they were. Topologies that hold N ranks (None: the
# launcher's LOCAL_WORLD_SIZE, one node here), and one that does not (refused: ValueError at apply, which says
# A x B = N). A pruned run is compared with its one-process reference within CSA_TOL (fp64); keep-all (every
# used level 1.0) with the unpatched model, within the oracle's fp64 tolerance.
CSA_SHARE = 0.2
CSA_TOPOLOGIES = {
    2: ["2x1", "2x1", "1x2", "2", "1x1x2", None],
    3: ["3x1", "3x1", "1x3", "3", None],
    4: ["2x2", "2x2", "2x2", "4x1", "1x4", "2x1x2", "1x2x2", None],
}
CSA_OBSERVE = [1, 3, 8, 64]
# hybrids whose layer layout is a property of the layer count, not a list `deepened` can repeat: kept at their
# depth (one full-attention layer: CSA keeps every token there, so they test the chain's plumbing only)
CSA_SHALLOW = {"bamba", "falcon_h1", "jamba", "zamba2"}
CSA_TOL = 1e-10


def _rope_factors(n: int):
    return [1.0 + 0.05 * i for i in range(n)], [1.0 + 3.0 * i for i in range(n)]


_SHORT, _LONG = _rope_factors(8)  # head_dim 16: 8 frequencies
ROPE_OVERRIDES = {  # thresholds of 64 positions, so the drawn prompts (1 to 300 tokens) cross them
    "linear": dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=10000.0)),
    "dynamic": dict(
        rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0), max_position_embeddings=64
    ),
    "yarn": dict(
        rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=10000.0, original_max_position_embeddings=64),
        max_position_embeddings=256,
    ),
    "llama3": dict(
        rope_parameters=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            rope_theta=10000.0,
            original_max_position_embeddings=64,
        ),
        max_position_embeddings=512,
    ),
    "longrope": dict(
        rope_parameters=dict(
            rope_type="longrope",
            short_factor=_SHORT,
            long_factor=_LONG,
            rope_theta=10000.0,
            original_max_position_embeddings=64,
        ),
        max_position_embeddings=256,
        original_max_position_embeddings=64,
    ),
}


# -- the case ---------------------------------------------------------------------------------
# the census's verified families drawn on no other list: plain AttentionInterface models it verified with no family
# patch, on its tiny configs (not their text configs that no causal LM class takes: Mllama's is drawn whole, as
# `mllama` in CENSUS_CONFIGS; Emu3's is built by the census from its multimodal config)
BUILT_WHOLE = {"emu3_text_model", "mllama_text_model"}


@functools.cache
def verified_plain() -> list:
    drawn = {*REGISTERED, *HYBRIDS, *LISTED, *(model_type(f) for f in (*GEOMETRIES, *OPTED_IN, *CENSUS_CONFIGS))}
    return sorted(mt for mt in VERIFIED if mt not in drawn and mt not in BUILT_WHOLE)


def on_census_config(family: str) -> bool:
    """Drawn on the census's tiny config (CENSUS_CONFIGS, a variant of one, or a plain verified family)."""
    return family in CENSUS_CONFIGS or family in verified_plain()


def model_type(family: str) -> str:
    if family in GEOMETRIES:
        return GEOMETRIES[family]["model_type"]
    if family in CENSUS_VARIANTS:
        return CENSUS_VARIANTS[family][0]
    return OPTED_IN[family]["model_type"] if family in OPTED_IN else family


def _length(r: random.Random, n: int, longest: int = 300) -> int:
    """Prompt lengths 1 to `longest`, weighted to the edges: 1, below/around N, short, long."""
    u, short = r.random(), longest * 3 // 10
    if u < 0.12:
        return 1
    if u < 0.35:
        return r.randint(2, 2 * n + 2)
    if u < 0.8:
        return r.randint(2 * n + 3, short)
    return r.randint(short + 1, longest)


def draw_case(seed: int, n: int, index: int) -> dict:
    """Case `index` of `seed` on `n` ranks: a plain dict of everything that defines it."""
    r = random.Random(f"{seed}/{n}/{index}")
    u = r.random()
    family = (
        r.choice(REGISTERED)
        if u < 0.45
        else r.choice(CENSUS_CONFIGS)
        if u < 0.5
        else r.choice(sorted(OPTED_IN))
        if u < 0.56
        else r.choice(verified_plain())
        if u < 0.62
        else r.choice(HYBRIDS + LISTED)
        if u < 0.8
        else r.choice(sorted(GEOMETRIES))
    )
    # Phi-3's config accepts only default and longrope; longrope is Phi-3's alone
    ropes = (
        ["default"]
        if family in GEOMETRIES or family in HYBRIDS or family in LISTED or on_census_config(family)
        else ["default", "longrope"]
        if family == "phi3"
        else [x for x in ROPES if x != "longrope"]
    )
    rope = "default" if r.random() < 0.4 else r.choice(ropes)
    case = dict(
        seed=seed,
        n=n,
        index=index,
        family=family,
        dtype=r.choice(["float64", "float32"]),
        rope=rope,
        strategy=r.choice(STRATEGIES),
        decode=r.choice(DECODES),
        data_seed=r.randrange(2**31),
    )
    if family in FP32_ONLY:
        case["dtype"] = "float32"
    padding = r.choice(PADDINGS)
    batch = r.randint(1, n + 1)
    # RWKV refuses padding and batched decode steps (patches/rwkv.py), and decode='ring_pass_q' (as every recurrent
    # model does): three cases in four are one unpadded sequence and another decode, so that most of its cases run
    # (drawn from a stream of its own: the other draws stay as they were)
    listed = random.Random(f"{seed}/{n}/{index}/listed")
    if family in LISTED and listed.random() < 0.75:
        padding, batch = "none", 1
        case["decode"] = listed.choice(["auto", "replicated"])
    if padding == "packed":
        batch = 1
    if padding == "all_pad_row" and batch == 1:
        batch = 2
    turns_wanted = 1 if padding == "packed" else r.choice([1, 1, 2, 3])
    cache = r.choice(["returned", "returned", "inplace"])
    if family in GIVEN_CACHE:  # it returns no cache (its states are its modules'): the caller keeps one
        cache = "inplace"
    if family in LISTED:  # the list it returns is the one it fills in place when passed back: one way to hand it on
        cache = "returned"
    # per turn: a mode; assisted / prompt lookup need one sequence, beam search ends the conversation
    turns, rows = [], batch
    for t in range(turns_wanted):
        modes = ["forward", "greedy", "greedy", "sample", "beam"] + (["assisted", "lookup"] if rows == 1 else [])
        mode = "forward" if padding == "packed" else r.choice(modes)
        turn = dict(mode=mode, new_tokens=r.randint(4, 12))
        if t > 0:
            turn["chunk"] = _length(r, n, longest=80)
        if mode == "sample":
            turn["num_return_sequences"] = r.randint(1, 3)
            turn["sampler"] = r.choice([dict(top_k=0, top_p=1.0), dict(top_k=20), dict(top_p=0.9, temperature=0.7)])
            rows *= turn["num_return_sequences"]
        if mode == "beam":
            turn["num_beams"] = r.randint(2, 3)
            turn["num_return_sequences"] = r.randint(1, turn["num_beams"])
        turns.append(turn)
        if mode == "beam":
            break
    if padding in ("none", "holes"):  # holes are cut into equal-length rows
        lengths = [_length(r, n)] * batch
    else:
        lengths = [_length(r, n) for _ in range(batch)]
    if padding == "all_pad_row":
        lengths[r.randrange(batch)] = 0
    case.update(
        batch=batch,
        padding=padding,
        lengths=lengths,
        turns=turns,
        cache=cache,
        mask_given=padding != "packed" and (padding != "none" or r.random() < 0.5),
    )
    case["kv_interleave"] = r.choice(KV_INTERLEAVES)  # drawn late: the other draws of a seed stay as they were
    case["window"] = r.choice(WINDOWS)
    case["transport"] = r.choice(TRANSPORTS)
    # the caller's own cache: config-less DynamicCache() (every layer keeps every token) or the
    # DynamicCache(config=...) a model makes itself (sliding layers keep their window)
    # (a family that returns no cache keeps its states on its modules: one process takes DynamicCache() too, the
    # patched model refuses it with what to pass instead, DynamicCache(config=...))
    case["inplace_config"] = r.random() < 0.5 or case["family"] in GIVEN_CACHE
    # the name the cache goes in and comes out under: transformers 5.24 renamed past_key_values to
    # cache and keeps the old name as an alias (models that predate the rename take the old one only)
    case["cache_name"] = r.choice(["past_key_values", "cache"])
    # forward turns: the output as a ModelOutput or a tuple (return_dict=False), and which logits
    # to keep: all (0), an int (negative and past-the-end ones too) or an index tensor
    case["return_dict"] = r.random() < 0.6
    case["logits_to_keep"] = r.choice([0, 0, 0, 1, 3, -2, 1000, "index"])
    # drawn late as well: every layer's hidden states in forward turns (compared at every valid
    # position), and return_dict=False set on the config instead of passed (the model reads it there)
    case["hidden_states"] = r.random() < 0.3
    case["return_dict_via"] = "config" if r.random() < 0.2 else "argument"
    # inputs_embeds instead of input_ids: in forward turns, and in generate when it is the only turn
    # (generate then returns the new tokens alone, so a later turn has no prompt ids to extend)
    case["embeds"] = r.random() < 0.25
    case["embeds_with_ids"] = r.random() < 0.5  # generate(input_ids=..., inputs_embeds=...): both given
    # a later forward turn that adds no tokens (after a forward turn the input is then empty): one
    # process fails inside the model, the patched one must refuse it on every rank
    case["empty_turn"] = r.random() < 0.05
    # KV-Runahead's (and a hybrid's chain's) partitions: the default (balanced by measured work, uneven), even
    # (KVR-E, now only when asked), or a front-loaded table (halving: each rank keeps an even share of the K/V all
    # the same, plan._rebalanced)
    front = dict(world=n, entries={"16": [2.0**-i for i in range(n)]})
    case["partitions"] = r.choice([None, None, "even", front])
    # what users do around the model (issue 42), drawn last: the cache copied after every turn (the prompt-reuse
    # recipe: deep copy, pickle or torch.save round trip, on both sides), and user code the library must refuse
    # on every rank (a custom attention function registered with transformers, an attention forward patched to
    # call SDPA itself, register() of a family the library lists) or run exactly (re-registering an opted-in one)
    case["copy_cache"] = r.choice([None, None, None, "deepcopy", "pickle", "torch_save"])
    case["user_code"] = r.choice([None] * 21 + ["custom_attention", "bypass", "reregister"])
    if case["user_code"] == "bypass" and indexed(case):  # its SDPA branch scatters the global top-k into a local
        case["user_code"] = None  # mask and fails in torch (IndexError) before the coverage check could refuse it
    case["csa"] = draw_csa(seed, n, index)
    if case["csa"] is not None:
        _within_csa(case, random.Random(f"{seed}/{n}/{index}/csa/case"))
    return case


def draw_csa(seed: int, n: int, index: int) -> dict | None:
    """The approximate mode's settings for a CSA case (None: an exact case), from a stream of its own: keep-all
    (1.0 on every level), 1.0 alone (the farther levels keep half), one random fraction or one per level; a
    topology for N (one in twenty that does not hold N ranks: refused); the observed query rows."""
    r = random.Random(f"{seed}/{n}/{index}/csa")
    if r.random() >= CSA_SHARE:
        return None
    u = r.random()
    if u < 0.2:
        keep = [1.0, 1.0, 1.0]  # keep-all: the exact result, compared with the unpatched model
    elif u < 0.35:
        keep = 1.0
    elif u < 0.7:
        keep = round(r.uniform(0.05, 1.0), 2)
    else:
        keep = sorted((round(r.uniform(0.05, 1.0), 2) for _ in range(2)), reverse=True)
    topology = r.choice(CSA_TOPOLOGIES[n]) if r.random() >= 0.05 else f"{n + 1}x1"
    return dict(keep=keep, topology=topology, observe=r.choice(CSA_OBSERVE))


def _within_csa(case: dict, r: random.Random) -> None:
    """What a CSA case keeps of the exact draw. A family CSA runs, four times in five: most families refuse it
    (every layer sliding, recurrent only, MLA, sinks, chunks, shared K/V), and a refusal at apply tests one
    line. fp64 (its reference is checked to 1e-10). No user attention code: the reference replaces the model's
    attention function for the block, so a user's would not run on one process. No packed sequences: refused
    before CSA is reached, so they test nothing of it (an unpadded prompt instead). The rest (padding, lengths,
    turns, strategies for the later turns, decode) stays as drawn."""
    if (csa_refuses(case) and r.random() < 0.8) or case["family"] in FP32_ONLY:  # its reference is fp64 (below)
        case["family"], case["rope"] = r.choice(csa_families()), "default"
    # 3 full-attention layers, so the middle one prunes (else CSA keeps all); a family CSA refuses stays as it is
    case["csa_deep"] = r.random() < 0.85 and case["family"] in csa_families()
    case["dtype"] = "float64"
    if case.get("user_code") in ("custom_attention", "bypass"):
        case["user_code"] = None
    if case["padding"] == "packed":
        case["padding"] = "none"
    # placement decides levels: a pruning case's reference cuts the partitions the run does, which the case names
    # when they are even or a table's (front-loaded); keep-all cases draw the balanced default too (exact)
    if case["partitions"] in (None, "balanced") and csa_fits(case) and not csa_keeps_all(case):
        case["partitions"] = r.choice(
            ["even", dict(world=case["n"], entries={"16": [2.0**-i for i in range(case["n"])]})]
        )


def csa_of(case: dict) -> CSA | None:
    """The case's CSA settings (lists in the JSON case, tuples in CSA), or None."""
    spec = case.get("csa")
    if not spec:
        return None
    keep = tuple(spec["keep"]) if isinstance(spec["keep"], list) else spec["keep"]
    return CSA(keep=keep, topology=spec["topology"], observe=spec["observe"])


def csa_fits(case: dict) -> bool:
    """The topology holds the case's N ranks (else apply refuses it, with a ValueError that says A x B = N)."""
    try:
        csa_of(case).resolved(case["n"])
    except ValueError:
        return False
    return True


def csa_keeps_all(case: dict) -> bool:
    """Every level this topology uses keeps every token: the exact result, compared with the unpatched model."""
    return csa_fits(case) and csa_of(case).resolved(case["n"]).exact


@functools.cache
def csa_families() -> tuple:
    """The fuzz's families CSA runs (a full-attention layer, no layer kind it refuses), in a fixed order."""
    every = [*REGISTERED, *sorted(OPTED_IN), *HYBRIDS, *CENSUS_CONFIGS, *verified_plain(), *sorted(GEOMETRIES)]
    # sinks read off the config alone (GPT-OSS's): building every family to look for them would cost the first CSA case
    # tens of seconds; a family with learned sinks drawn from here is refused as predicted (`csa_refuses`)
    return tuple(
        f for f in every if f not in FP32_ONLY and not csa_refuses(dict(family=f, rope="default"), build=False)
    )


SHARED_ATTENTION = {"zamba", "zamba2"}  # one attention module (layer_idx None / -1) for several layers: no CSA


def csa_refuses(case: dict, build: bool = True) -> bool:
    """The family has a layer kind CSA does not define (chunked attention, sinks, MLA, shared K/V, no full
    attention, a family patch that makes its layers attend otherwise, one attention module shared by several
    layers): refused at apply with an UnsupportedModelError. build: look for learned sinks on the model (else on the
    config: GPT-OSS's)."""
    family = REGISTRY.get(model_type(case["family"]))
    if (family is not None and not family.csa) or case["family"] in SHARED_ATTENTION:
        return True
    config = build_config(case["family"], case["rope"], case.get("window"))
    if getattr(config, "alibi", False):  # Falcon-RW's ALiBi, refused at its first forward (a score bias from positions)
        return True
    sinks = learned_sinks(case["family"]) if build else config.model_type == "gpt_oss"
    try:  # GPT-OSS's, Flint's, Granite SWA's attention modules hold learned sinks (apply finds them on the model)
        refuse_csa_layers(config, sinks=sinks)
    except hf_contextpar.UnsupportedModelError:
        return True
    return False


@functools.cache
def learned_sinks(family: str) -> bool:
    """Do the family's attention modules hold learned sinks (model/contract.has_sinks, what apply checks)?"""
    return has_sinks(build_model(dict(family=family, rope="default"), torch.float32))


def chained(case: dict) -> bool:
    """A family with recurrent layers, whose states pass down the ranks in prefill (a chain)."""
    family = case["family"]
    return family in HYBRIDS or family in LISTED or model_type(family) in CENSUS_CHAINED  # a geometry: its family's


def indexed(case: dict) -> bool:
    """A family with indexed attention (DSA): its queries stay with their indexer's selection."""
    family = REGISTRY.get(model_type(case["family"]))  # a geometry's name is not its family's
    return family is not None and family.indexed


def compressed(case: dict) -> bool:
    """A family with compressed attention (DeepSeek-V4's CSA / HCA): its queries stay with their entries' bias."""
    family = REGISTRY.get(model_type(case["family"]))
    return family is not None and family.compressed


def describe(case: dict) -> str:
    short = dict(new_tokens="new", chunk="chunk", num_return_sequences="nrs", num_beams="beams")
    turns = ", ".join(
        t["mode"]
        + "("
        + ",".join(
            [f"{short[k]}={v}" for k, v in t.items() if k in short]
            + [f"{k}={v}" for k, v in t.get("sampler", {}).items()]
        )
        + ")"
        for t in case["turns"]
    )
    return (
        f"family={case['family']} dtype={case['dtype']} rope={case['rope']} strategy={case['strategy']} "
        f"decode={case['decode']} kv_interleave={case.get('kv_interleave', 1)} partitions={'front' if isinstance(case.get('partitions'), dict) else case.get('partitions')} window={case.get('window')} transport={case.get('transport', 'shm')} batch={case['batch']} padding={case['padding']} lengths={case['lengths']} "
        f"mask={'yes' if case['mask_given'] else 'no'} cache={case['cache']} "
        f"cache_name={case.get('cache_name', 'past_key_values')} return_dict={case.get('return_dict', True)} "
        f"logits_to_keep={case.get('logits_to_keep', 0)} hidden_states={case.get('hidden_states', False)} "
        f"return_dict_via={case.get('return_dict_via', 'argument')} embeds={case.get('embeds', False)}{'+ids' if case.get('embeds_with_ids') else ''}{' empty_turn' if case.get('empty_turn') else ''} copy_cache={case.get('copy_cache')} user_code={case.get('user_code')} turns=[{turns}]"
        + (f" csa={case['csa']}{' deep' if case.get('csa_deep') else ''}" if case.get("csa") else "")
    )


def reproduce_command(case: dict) -> str:
    return (
        f"OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node {case['n']} tests/workers/fuzz_worker.py "
        f"--seed {case['seed']} --case {case['index']}{case.get('overrides', '')}"
    )


# -- models and inputs ------------------------------------------------------------------------
def build_config(family: str, rope: str = "default", window: int | None = None, deep: bool = False):
    """The config of a drawn family with the drawn RoPE type and, for a family with sliding layers
    (not the fixed real geometries), the drawn window; `deep`: enough layers for CSA to prune (`deepened`)."""
    if family in GEOMETRIES:
        config = geometry_config(family)
    elif family in HYBRIDS or family in LISTED:  # their realistic layer mix (tests/workers/hybrids.py)
        config = hybrid_config(family)
    elif on_census_config(family):  # the census's tiny configs (its drawn window kept out: Moshi's attention has none)
        config = census_family_config(family)
    else:
        config = _family_config(family, rope)
        if window and getattr(config, "sliding_window", None):
            config.sliding_window = window
    return deepened(config) if deep and family not in CSA_SHALLOW else config


def deepened(config):
    """The config with its layer pattern repeated until it has 3 full-attention layers: CSA keeps every token
    in the first and the last, so a tiny model's 1 or 2 would never prune. Every per-layer list (layer types,
    NoPE layers, ...) is repeated with it."""
    from hf_contextpar.sparse.csa import full_layers

    text = config.get_text_config(decoder=True)
    n, full = text.num_hidden_layers, len(full_layers(config))
    times = -(-3 // full) if full else 1
    for key, value in list(vars(text).items()):
        if isinstance(value, list) and len(value) == n:
            setattr(text, key, value * times)
    text.num_hidden_layers = n * times
    return config


def _family_config(family: str, rope: str):
    overrides = copy.deepcopy(ROPE_OVERRIDES.get(rope, {}))  # configs edit rope dicts in place
    if overrides and model_type(family) in ("gemma3_text", "gemma4_text"):  # per-layer-type RoPE: global layers take it
        overrides["rope_parameters"] = {
            "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
            "full_attention": overrides["rope_parameters"],
        }
    if family in REGISTERED:
        return tiny_config(family, **overrides)
    spec = copy.deepcopy({**_BASE, **OPTED_IN[family], **overrides})
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def build_model(case: dict, dtype: torch.dtype, seed: int = 0):
    """The case's unpatched model, seeded: the same weights on every rank and for the reference."""
    config = build_config(case["family"], case["rope"], case.get("window"), case.get("csa_deep", False))
    # the family's reference kernel (HF runs Gemma2's soft-capping and gpt-oss's sinks only in eager)
    impl = REGISTRY[config.model_type].reference_attn if config.model_type in REGISTRY else "sdpa"
    kw = dict(attn_implementation=impl) if getattr(config, "num_attention_heads", None) else {}  # Mamba2: none
    if case["family"] in HYBRIDS or on_census_config(case["family"]):  # grouped MoE matmuls have no fp64 CPU kernel
        kw["experts_implementation"] = "eager"
    torch.manual_seed(seed)
    model = drawn_zero_init(AutoModelForCausalLM.from_config(config, dtype=dtype, **kw)).eval()
    if case.get("user_code") == "custom_attention" and "attn_implementation" in kw:  # both sides: one process runs it
        AttentionInterface.register("fuzz_logn", _logn_attention)
        model.set_attn_implementation("fuzz_logn")
    if case.get("user_code") == "bypass":
        call_sdpa_itself(model)
    return model


def _logn_attention(module, query, key, value, attention_mask, scaling=None, **kw):
    """A user's attention function: log-n query scaling (a long-context extrapolation trick) over SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    scale = torch.log(torch.tensor(float(key.shape[-2] + 1), dtype=query.dtype)).clamp(min=1.0)
    return sdpa_attention_forward(module, query * scale, key, value, attention_mask, scaling=scaling, **kw)


def copied(cache, how: str | None):
    """The cache as the prompt-reuse recipe hands it on: a deep copy, or a pickle or torch.save round trip."""
    if cache is None or how is None:
        return cache
    if how == "deepcopy":
        return copy.deepcopy(cache)
    if how == "pickle":
        return pickle.loads(pickle.dumps(cache))
    buf = io.BytesIO()
    torch.save(cache, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def internals(case: dict):
    """A hybrid's fp32 internals (chunked scans, gates; DeepSeek-V4's compressors) run in fp64 in an fp64 case, on
    both sides: split at other points, they alone would move fp64 logits by ~1e-6."""
    fp32_parts = chained(case) or compressed(case) or on_census_config(case["family"])
    return Fp64Internals() if fp32_parts else contextlib.nullcontext()


def first_prompt(case: dict, g: torch.Generator):
    """(input_ids, attention_mask or None, position_ids or None, comparable rows) of turn 1."""
    lengths, padding = case["lengths"], case["padding"]
    width = max(max(lengths), 1)
    ids = torch.full((len(lengths), width), PAD_ID)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        if n == 0:
            continue
        cols = slice(0, n) if padding == "right" else slice(width - n, width)
        ids[i, cols] = torch.randint(0, 256, (n,), generator=g)
        mask[i, cols] = 1
    if padding == "holes":  # a few zeros anywhere; every row keeps at least one real token
        for i in range(len(lengths)):
            holes = torch.rand(width, generator=g) < 0.2
            holes[int(torch.randint(0, width, (1,), generator=g))] = False
            mask[i, holes] = 0
            ids[i, holes] = PAD_ID
    position_ids = None
    if padding == "packed":  # 2-4 sequences packed in one row, positions restarting at 0
        cuts = sorted(set(int(c) for c in torch.randint(1, width, (3,), generator=g))) if width > 1 else []
        bounds = [0, *cuts, width]
        position_ids = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])]).unsqueeze(0)
    comparable = torch.tensor([n > 0 for n in lengths])
    return ids, (mask if case["mask_given"] else None), position_ids, comparable


def generate_kwargs(turn: dict, assistant):
    m = turn["new_tokens"]
    kw = dict(max_new_tokens=m, min_new_tokens=m, pad_token_id=PAD_ID, return_dict_in_generate=True)
    mode = turn["mode"]
    if mode == "sample":
        kw.update(do_sample=True, num_return_sequences=turn["num_return_sequences"], **turn["sampler"])
    else:
        kw.update(do_sample=False)
    if mode == "beam":
        kw.update(num_beams=turn["num_beams"], num_return_sequences=turn["num_return_sequences"], early_stopping=False)
    kw.update(output_logits=True)
    if mode == "assisted":
        kw.update(assistant_model=assistant)
    if mode == "lookup":
        kw.update(prompt_lookup_num_tokens=3)
    return kw


def smallest_window(config) -> int | None:
    """The narrowest sliding window of the model's layers (None: every layer attends to all keys)."""
    window, types = getattr(config, "sliding_window", None), getattr(config, "layer_types", None)
    if "local" in (getattr(config, "attention_layers", None) or []):  # GPT-Neo's local layers: window_size keys
        return config.window_size
    return window if window and (types is None or "sliding_attention" in types) else None


def sees_a_key(mask: torch.Tensor | None, window: int | None) -> torch.Tensor | None:
    """(rows,) bool: does each row's last query see at least one real key in every layer? A padded
    last query with no key in a window (right padding, a hole at the end) gets a kernel-specific
    output, like an all-padding row."""
    if mask is None:
        return None
    return mask[:, -window:].bool().any(1) if window else mask.bool().any(1)


@torch.no_grad()
def conversation(model, case: dict, make_assistant):
    """Run the case's turns on `model`, yielding one result per turn (the caller may stop early).

    Turn 1 is the drawn prompt; each later turn appends a user chunk to every row (mask ones) and
    passes the cache on: `out.past_key_values` or `out.cache` ("returned") or the caller's own DynamicCache (with
    or without the model's config: sliding layers or none), passed again every turn ("inplace"). Generation runs `generate(input_ids=everything so far,
    past_key_values=cache)` (or `cache=cache`, transformers >= 5.24), as transformers documents multi-turn
    generation. A family whose states are a list of its own (LISTED: RWKV) takes it back as `state=` with the tokens it
    has not seen alone, in generate() too (one process reads every token given as new there), and returns it as
    `state` (forward) or `past_key_values` (generate)."""
    g = torch.Generator().manual_seed(case["data_seed"])
    ids, mask, position_ids, comparable = first_prompt(case, g)
    cache = None
    name = case.get("cache_name", "past_key_values") if cache_argument(model) == "cache" else "past_key_values"
    listed = case["family"] in LISTED
    if listed:
        name = "state"
    if case["cache"] == "inplace":
        cache = DynamicCache(config=model.config) if case.get("inplace_config") else DynamicCache()
    seq, cached = None, 0  # the sequence so far, and how many of its tokens the cache holds
    embed = model.get_input_embeddings()
    for t, turn in enumerate(case["turns"]):
        if t == 0:
            full = ids
        else:
            width = 0 if case.get("empty_turn") and turn["mode"] == "forward" else turn["chunk"]
            chunk = torch.randint(0, 256, (seq.shape[0], width), generator=g)
            full = torch.cat([seq, chunk], 1)
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(chunk)], 1)
        new = full[:, cached:]  # after generate(), the last token's K/V is not in the cache yet
        mode = turn["mode"]
        if mode == "forward":
            # a last turn needs no cache, and without one transformers reads packed position_ids as
            # separate sequences (a block-diagonal mask)
            use_cache = t + 1 < len(case["turns"])
            kw = {"attention_mask": mask, name: cache, "use_cache": use_cache}
            if position_ids is not None:
                kw["position_ids"] = position_ids
            keep, num_new = case.get("logits_to_keep", 0), new.shape[1]
            if "logits_to_keep" not in inspect.signature(type(model).forward).parameters:
                keep = 0  # a forward that ignores it (xLSTM's) computes every row, on one process too
            if keep == "index":  # a few positions, negative ones and repeats allowed
                pick = torch.Generator().manual_seed(case["data_seed"] + 1 + t)
                keep = torch.randint(-num_new, num_new, (min(num_new, 3),), generator=pick)
            kept = torch.arange(num_new)[slice(-keep, None) if isinstance(keep, int) else keep]
            hidden = bool(case.get("hidden_states"))
            inputs = {"inputs_embeds": embed(new)} if case.get("embeds") else {"input_ids": new}
            out = forward(model, case, inputs, kw, keep, hidden)
            if isinstance(out, tuple):  # (logits, [cache], [hidden states]): to_tuple() leaves out the Nones
                caches = [x for x in out[1:] if isinstance(x, list if listed else Cache)]
                states = [x for x in out[1:] if isinstance(x, tuple)]
                out = types.SimpleNamespace(
                    logits=out[0], hidden_states=states[0] if states else None, **{name: (caches or [None])[0]}
                )
            valid = comparable[:, None].expand(-1, num_new).clone()
            if mask is not None:
                valid &= mask[:, -num_new:].bool()
            result = dict(mode=mode, tokens=None, logits=out.logits, valid=valid[:, kept], rows=new.shape[0])
            if hidden:  # (layers + 1, rows, positions, hidden): every position, whatever logits_to_keep
                result.update(hidden=torch.stack(out.hidden_states), hidden_valid=valid)
            seq, cached = full, full.shape[1]
        else:
            kw = generate_kwargs(turn, make_assistant() if mode == "assisted" else None)
            if mode == "sample":  # the same seed for the reference and on every rank, right before the call
                torch.manual_seed(case["data_seed"] + t)
            from_embeds = case.get("embeds") and len(case["turns"]) == 1
            given = full[:, cached:] if listed and cache is not None else full  # a state list has seen the rest
            inputs = {"inputs_embeds": embed(full)} if from_embeds else {"inputs": given}
            if from_embeds and case.get("embeds_with_ids"):
                inputs["input_ids"] = full
            out = model.generate(**inputs, attention_mask=mask, **{name: cache}, **kw)
            if given is not full:  # the whole sequence, as generate() returns it for a Cache
                seen = full[:, :cached].repeat_interleave(out.sequences.shape[0] // full.shape[0], 0)
                out.sequences = torch.cat([seen, out.sequences], 1)
            if (defined := sees_a_key(mask, smallest_window(model.config))) is not None:
                comparable = comparable & defined  # the first new token comes from the last query
            expand = out.sequences.shape[0] // full.shape[0]
            comparable = comparable.repeat_interleave(expand)
            logits = torch.stack(out.logits, 1)  # (rows, steps, vocab); beam search: (batch x beams, ...)
            # rows whose logits are finite: a reference's tokens from NaN logits mean nothing (HF's fp64
            # eager Gemma2 NaNs on padding, and 0 x NaN spreads it to real rows; beam search stops early)
            finite = torch.isfinite(logits).flatten(1).all(1)
            finite = finite.all().expand(len(comparable)) if mode == "beam" else finite
            result = dict(
                mode=mode,
                tokens=out.sequences,
                rows=full.shape[0],
                # generate from embeddings alone returns the new tokens only
                prompt_length=0 if "inputs_embeds" in inputs and "input_ids" not in inputs else full.shape[1],
                comparable=comparable.clone(),
                finite=finite.clone(),
                logits=None if mode == "beam" else logits,  # beams' rows do not map to sequences
                valid=None if mode == "beam" else comparable[:, None].expand(-1, logits.shape[1]).clone(),
            )
            seq, cached = out.sequences, out.sequences.shape[1] - 1
            if mask is not None:
                mask = torch.cat(
                    [
                        mask.repeat_interleave(expand, 0),
                        torch.ones(seq.shape[0], seq.shape[1] - full.shape[1], dtype=mask.dtype),
                    ],
                    1,
                )
        if case["cache"] == "returned":
            cache = out.past_key_values if listed and mode != "forward" else getattr(out, name)
        cache = copied(cache, case.get("copy_cache"))
        yield result


def forward(model, case: dict, inputs: dict, kw: dict, keep, hidden: bool):
    """One forward turn; return_dict=False passed as an argument or set on the config for this call."""
    kw = dict(kw, **inputs, logits_to_keep=keep, output_hidden_states=hidden)
    if case.get("return_dict_via") != "config" or case.get("return_dict", True):
        return model(**kw, return_dict=case.get("return_dict", True))
    model.config.return_dict = False
    try:
        return model(**kw)
    finally:
        model.config.return_dict = True


# -- comparison -------------------------------------------------------------------------------
def tolerance(case: dict) -> float:
    """Max |logit diff| against the unpatched single process: the oracle's for the case's dtype and
    model type (Gemma2's fp64 reference computes its softmax in fp32)."""
    if case.get("csa") and not csa_keeps_all(case):  # against its own fp64 reference: no model's fp32 in between
        return CSA_TOL
    if compressed(case) and case["dtype"] == "float64":  # its fp32 internals run in fp64 (`internals`)
        return FLOAT_TOL[torch.float64]
    return logit_tolerance(model_type(case["family"]), case["dtype"])


def digest(result: dict) -> str:
    return tensors_digest(result.get(key) for key in ("tokens", "logits", "hidden"))


def compare_turn(case: dict, t: int, ref: dict, mine: dict) -> tuple[str, str]:
    """('ok' | 'fail' | 'near_tie' | 'reference_nan', detail) for turn t."""
    tol = tolerance(case)
    if mine["mode"] != "forward" and mine["tokens"].shape != ref["tokens"].shape:
        where = f"turn {t + 1}: sequences shape {tuple(mine['tokens'].shape)} != {tuple(ref['tokens'].shape)}"
        return ("fail" if ref["finite"].all() else "reference_nan"), where
    steps = None  # logit steps to compare: all, or up to the first token divergence
    if mine["mode"] != "forward":
        rows = ref["comparable"]
        if rows.any() and not torch.equal(mine["tokens"][rows], ref["tokens"][rows]):
            if not ref["finite"][rows].all():
                return (
                    "reference_nan",
                    f"turn {t + 1} ({mine['mode']}): tokens differ where the reference's logits are NaN",
                )
            diff = (mine["tokens"][rows] != ref["tokens"][rows]).nonzero()
            row = int(rows.nonzero()[int(diff[0, 0])]) if diff.numel() else 0
            col = int(diff[diff[:, 0] == diff[0, 0], 1].min())
            step = col - ref["prompt_length"]
            where = f"turn {t + 1} ({mine['mode']}): tokens differ, row {row} first at new token {step}"
            if ref["logits"] is None:
                return "fail", where
            steps = step + 1
            d = _logit_diff(ref, mine, steps)
            if d > tol:
                return "fail", f"{where}; logits differ by {d:.3g} (tolerance {tol:g})"
            margin = top2_margin(ref["logits"][row, step])
            if (
                case["dtype"] == "float32"
                and mine["mode"] in ("greedy", "assisted", "lookup")
                and near_tie(margin, tol)
            ):
                return "near_tie", f"{where}; reference margin {margin:.3g} <= 2 x tolerance"
            return "fail", f"{where}; logits within {d:.3g}, reference margin {margin:.3g}"
    if ref["logits"] is not None:
        d = _logit_diff(ref, mine, steps)
        if d > tol:
            return "fail", f"turn {t + 1} ({mine['mode']}): max |logit diff| {d:.3g} > {tol:g}"
    if ref.get("hidden") is not None:
        d = _hidden_diff(ref, mine)
        if d > tol:
            return "fail", f"turn {t + 1} (forward): hidden states differ by {d:.3g} (relative) > {tol:g}"
    return "ok", ""


def _hidden_diff(ref: dict, mine: dict) -> float:
    """Max |diff| of every layer's hidden states at valid positions where the reference is finite,
    over the reference's largest magnitude there (at least 1): residual streams grow with depth."""
    a, b = ref["hidden"], mine.get("hidden")
    if b is None or a.shape != b.shape:
        return math.inf
    valid = ref["hidden_valid"]
    a, b = a.flatten(0, a.dim() - 4), b.flatten(0, b.dim() - 4)  # Gemma 3n stacks AltUp's 4 streams per layer
    a, b = a[:, valid].double(), b[:, valid].double()  # (layers + 1, positions, hidden)
    finite = torch.isfinite(a).all(-1).all(0)
    a, b = a[:, finite], b[:, finite]
    if not torch.isfinite(b).all():
        return math.inf
    return float((a - b).abs().max() / a.abs().max().clamp(min=1)) if a.numel() else 0.0


def _logit_diff(ref: dict, mine: dict, steps: int | None) -> float:
    """Max |diff| over valid positions where the reference is finite; inf where ours is not finite there."""
    a, b = ref["logits"], mine["logits"]
    if b is None or a.shape != b.shape:
        return math.inf
    valid = ref["valid"].clone()
    if steps is not None:
        valid[:, steps:] = False
    a, b = a[valid].double(), b[valid].double()
    finite = torch.isfinite(a).all(-1)
    a, b = a[finite], b[finite]
    if not torch.isfinite(b).all():
        return math.inf
    return float((a - b).abs().max()) if a.numel() else 0.0


def expected_error(case: dict, exc: Exception, decode_rows: int | None, turn: int) -> bool:
    """The documented refusals, told apart by type (hf_contextpar.errors), never by message. `turn`:
    index of the turn that raised."""
    if case.get("csa") and type(exc) is hf_contextpar.UnsupportedModelError and csa_refuses(case):
        return True  # at apply: a layer kind CSA does not define
    if case.get("csa") and type(exc) is ValueError and not csa_fits(case):
        return True  # at apply: a topology that does not hold N ranks
    if isinstance(exc, hf_contextpar.HeadsNotDivisibleError):  # at apply
        return case["strategy"] == "ulysses" and not ulysses_fits(case)
    user = case.get("user_code")
    if type(exc) is hf_contextpar.RegistrationError:  # register() of a family the library lists
        return user == "reregister"
    attends = getattr(build_config(case["family"]).get_text_config(decoder=True), "num_attention_heads", None)
    if type(exc) is hf_contextpar.UnsupportedModelError and user in ("custom_attention", "bypass") and attends:
        return True  # at apply (a custom attention function) or at the first forward (a layer calling SDPA itself)
    hybrid = chained(case)
    if isinstance(exc, hf_contextpar.UnsupportedModelError) and (hybrid or indexed(case)):
        # at apply: batched pass-Q decode would move states; a query would leave the rank its top-k was chosen on
        moves_queries = case["strategy"] in ("ring_pass_q", "ulysses")
        held = indexed(case) or compressed(case) or model_type(case["family"]) in PER_QUERY  # queries stay home
        return case["decode"] == "ring_pass_q" or (held and moves_queries)
    if (
        type(exc) is hf_contextpar.UnsupportedInputError
        and hybrid
        and case["turns"][turn]["mode"]
        in (
            "assisted",
            "lookup",
        )
    ):  # a cache recording its past: the conv states would grow per rank
        return True
    if type(exc) is hf_contextpar.UnsupportedInputError and case["family"] == "minimax_m3_vl_text":
        return case["padding"] != "none"  # a token whose own key block is padding (patches/minimax_m3.py check_mask)
    if (
        type(exc) is hf_contextpar.UnsupportedInputError
        and case["family"] in LISTED
        and listed_refuses(case, turn, decode_rows)
    ):
        return True
    beam = case["turns"][turn]["mode"] == "beam"
    if type(exc) is hf_contextpar.UnsupportedInputError and case["family"] in BEAMS_REFUSED and beam:
        return True  # one process does not reorder MiniMax's states with the beams
    generates = case["turns"][turn]["mode"] != "forward"
    if type(exc) is hf_contextpar.UnsupportedInputError and case["family"] in CACHED_GENERATE_REFUSED and generates:
        return turn > 0  # generate() over the returned cache: one process fails there or reads the history again
    if (
        type(exc) is hf_contextpar.UnsupportedInputError
        and hybrid
        and isinstance(REGISTRY[model_type(case["family"])].hooks, MaskedInput)
    ):
        return True  # Mamba1's models multiply the input by the mask: one column per token (one process broadcasts)
    if isinstance(exc, hf_contextpar.UnsupportedModelError):  # at apply: the one a drawn model can meet
        return (
            case.get("window") == 1
            and getattr(build_config(case["family"], case["rope"], 1), "sliding_window", None) == 1
        )
    if isinstance(exc, hf_contextpar.CandidateDecodingError):  # transformers drafts from input_ids
        return bool(case.get("embeds")) and case["turns"][turn]["mode"] in ("assisted", "lookup")
    if isinstance(exc, hf_contextpar.DecodeBatchError):
        return case["decode"] == "ring_pass_q" and decode_rows is not None and decode_rows < case["n"]
    if isinstance(exc, hf_contextpar.PackedSequenceError):  # per-document masks are not sharded
        return case["padding"] == "packed"
    if isinstance(exc, hf_contextpar.CacheMismatchError) and turn > 0 and not takes_cache_name(case):
        # a forward that does not alias the name (Mamba2's takes `cache`, alias `cache_params`) gets no cache, on
        # one process too: a later turn's mask is then longer than the (absent) cache says
        return True
    if isinstance(exc, hf_contextpar.CacheMismatchError):
        # transformers' assisted / prompt-lookup decoding over a cache filled by an earlier call feeds
        # the whole sequence again on top of the cache (the reference holds the context twice): refused
        # before generate() runs (model/candidates.py), and by a forward whose mask shows it
        over_filled = any(case["turns"][t]["mode"] in ("assisted", "lookup") for t in range(1, turn + 1))
        return over_filled or phi3_dropped_the_callers_cache(case, exc, turn)
    if type(exc) is hf_contextpar.UnsupportedInputError:  # a negative int's meaning is the model's own
        keep = case.get("logits_to_keep", 0)
        return isinstance(keep, int) and keep < 0 and case["turns"][turn]["mode"] == "forward"
    return False


def listed_refuses(case: dict, turn: int, rows: int | None) -> bool:
    """RWKV's refusals (patches/rwkv.py): a mask with padding (one process ignores it: padded tokens enter the state),
    beam search (one process does not reorder its state list), and a one-token forward of several rows with a state
    (one process broadcasts the rows' shift states against each other): every decode step of a batch, and a forward
    turn of one new token in a conversation (given a state, or asked for one with use_cache)."""
    spec = case["turns"][turn]
    g = torch.Generator().manual_seed(case["data_seed"])
    mask = first_prompt(case, g)[1]
    if spec["mode"] == "beam" or (mask is not None and not bool(mask.bool().all())):
        return True
    if rows is None or rows < 2:
        return False
    if spec["mode"] != "forward":
        return True
    return fed(case, turn) == 1 and len(case["turns"]) > 1


def fed(case: dict, turn: int) -> int:
    """The tokens a forward turn feeds (conversation's `new`): the prompt, or the chunk after the last turn's (after a
    generate() turn, its last token too: the cache has not seen it)."""
    if turn == 0:
        return max(max(case["lengths"]), 1)
    spec, before = case["turns"][turn], case["turns"][turn - 1]
    chunk = 0 if case.get("empty_turn") and spec["mode"] == "forward" else spec["chunk"]
    return chunk + (before["mode"] != "forward")


def causal_lm_class(case: dict):
    """The class AutoModelForCausalLM makes for the drawn family."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(build_config(case["family"]))]


def takes_a_cache(case: dict) -> bool:
    """Does the drawn family's forward take a cache at all (OpenAI GPT's does not: it runs the whole sequence)?"""
    params = inspect.signature(causal_lm_class(case).forward).parameters
    return "cache" in params or "past_key_values" in params or case["family"] in LISTED


def takes_cache_name(case: dict) -> bool:
    """Does the drawn family's forward take its cache under the case's name (`cache`, or a deprecated alias)?"""
    return case.get("cache_name", "past_key_values") in ("cache", *cache_aliases(causal_lm_class(case)))


def phi3_dropped_the_callers_cache(case: dict, exc: Exception, turn: int) -> bool:
    """Phi-3's prepare_inputs_for_generation drops a non-empty-looking cache (one an earlier turn
    filled, or DynamicCache(config=...), which has its layers from the start) when the prompt crosses
    original_max_position_embeddings (at the first step or the decode step that crosses it), so
    generate() goes on with a fresh cache and the caller's object keeps what it held before. A later
    turn passing it with the whole sequence's mask is refused; the reference runs it with a mask
    longer than its keys (e.g. seed 826137 case 1062 on N = 2: mask 78,
    cache 64 + 2 new tokens), an answer that skips the dropped turn's tokens."""
    if (
        model_type(case["family"]) != "phi3"
        or case["cache"] != "inplace"
        or not isinstance(exc, hf_contextpar.CacheMismatchError)
    ):
        return False
    rope = build_config(case["family"], case["rope"]).rope_parameters
    crossing = rope.get("original_max_position_embeddings") if isinstance(rope, dict) else None
    cached, width = 0, max(max(case["lengths"]), 1)  # as conversation() builds the sequence
    for t, spec in enumerate(case["turns"][:turn]):
        if t > 0:
            width += 0 if case.get("empty_turn") and spec["mode"] == "forward" else spec["chunk"]
        if spec["mode"] != "forward":
            # the drop happens at the step whose sequence first crosses, while the past is short of it
            if crossing and cached <= crossing < width + spec["new_tokens"] and (t > 0 or case.get("inplace_config")):
                return True
            width += spec["new_tokens"]
        cached = width
    return False


def ulysses_fits(case: dict) -> bool:
    """N divides the query and KV heads, and they are heads: MLA caches one latent for all of them."""
    config = build_config(case["family"]).get_text_config(decoder=True)  # Mllama's heads are its text config's
    latent = getattr(config, "kv_lora_rank", None) is not None
    if getattr(config, "num_attention_heads", None) is None:  # no attention layer (Mamba2): nothing to split
        return True
    if latent or case["family"] == "diffllama":  # DiffLlama's expansion of its cached V mixes the KV heads: refused
        return False
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads  # HRM's config: no GQA
    if compressed(case):  # DeepSeek-V4's attention is MQA (one K=V head) whatever num_key_value_heads says
        kv_heads = 1
    if config.model_type == "falcon" and not config.new_decoder_architecture:  # multi-query: one K/V head, else one
        kv_heads = 1 if config.multi_query else config.num_attention_heads  # per head (num_kv_heads is the new one's)
    if config.model_type == "gpt_bigcode" and config.multi_query:  # GPT-BigCode's multi-query: one K/V head
        kv_heads = 1
    if config.model_type == "dbrx":  # DBRX's K/V heads are its attention config's
        kv_heads = config.attn_config.kv_n_heads
    return config.num_attention_heads % case["n"] == 0 and kv_heads % case["n"] == 0


def decode_rows_of(turn: dict, rows: int) -> int:
    """Sequences in the decode steps of a turn: beams and extra samples multiply the batch."""
    return rows * turn.get("num_beams", turn.get("num_return_sequences", 1))


# -- one case on every rank -------------------------------------------------------------------
def run_reference(case: dict):
    """Rank 0: the unpatched model's turns, and the error that stopped them (None if none)."""
    with internals(case):
        return _run_reference(case)


def _run_reference(case: dict):
    dtype = getattr(torch, case["dtype"])
    turns = []
    try:
        ref = build_model(case, dtype)
        with reference_mode(case, ref):
            for result in conversation(ref, case, lambda: build_model(case, dtype)):
                turns.append(result)
    except Exception as e:
        return turns, f"{type(e).__name__}: {e}"
    return turns, None


def reference_mode(case: dict, model):
    """What the patched model is compared with: the unpatched model, or, for a CSA case that prunes, its
    one-process reference (the same definition as a mask, eval/csa_reference.py), which also refuses the
    layer kinds and topologies CSA refuses."""
    if case.get("csa") and not csa_keeps_all(case):
        table = case.get("partitions") if isinstance(case.get("partitions"), dict) else None
        return csa_reference(model, csa_of(case), case["n"], table)
    return contextlib.nullcontext()


def undefined_result(ref_error: str) -> bool:
    """A reference error that comes from a kernel-specific value, not from the input: sampling from NaN
    probabilities (a query with no visible key, see the module docstring). Ours may run there."""
    return "probability tensor contains" in ref_error


def run_patched(case: dict, ref_turns: list, ref_error: str | None = None) -> dict:
    """Every rank: the patched model's turns, compared with the reference's; where the reference
    raised at the turn after them, the patched model must raise too."""
    with internals(case):
        return _run_patched(case, ref_turns, ref_error)


def _run_patched(case: dict, ref_turns: list, ref_error: str | None = None) -> dict:
    dtype = getattr(torch, case["dtype"])
    rec = dict(outcome="pass", turns_compared=0, digests=[], detail="", error_type=None, error_turn=None)
    decode_rows = None
    cp = None
    try:
        cp = build_model(case, dtype)
        if case.get("user_code") == "reregister":  # an older README's opt-in: refused for a family the library lists
            register(FamilyPatch(cp.config.model_type, "registered again by the fuzz test"))
        hf_contextpar.apply_context_parallel(
            cp,
            strategy=case["strategy"],
            decode=case["decode"],
            kv_interleave=case.get("kv_interleave", 1),
            partitions=case.get("partitions"),
            timeout=CASE_TIMEOUT_S,
            sparse=csa_of(case),
        )
        if case.get("transport") == "gloo" and hf_contextpar.get_runtime(cp) is not None:
            hf_contextpar.get_runtime(cp).comm.close_shm()
        # DiffLlama's, JetMoE's and the ported families' refusals come at a forward that runs Ulysses: their layers hand
        # the attention other K/V heads than apply's probe sees (an expansion of the cached K/V; the K/V before JetMoE's
        # repeat), or apply's probe does not run their ported attention (Falcon's)
        later = model_type(case["family"]) in ("diffllama", "jetmoe", "falcon")
        if case["strategy"] == "ulysses" and not ulysses_fits(case) and not later:
            rec.update(outcome="fail", detail="expected HeadsNotDivisibleError for Ulysses, got none")
            return rec
        rows = case["batch"]
        turns = conversation(cp, case, lambda: build_model(case, dtype))
        for t, ref in enumerate(ref_turns):
            turn = case["turns"][t]
            decode_rows = decode_rows_of(turn, ref["rows"])
            mine = next(turns)
            rec["digests"].append(digest(mine))
            verdict, detail = compare_turn(case, t, ref, mine)
            rec["turns_compared"] = t + 1
            if verdict != "ok":
                rec.update(outcome=verdict, detail=detail)
                return rec
            if (
                case["decode"] == "ring_pass_q"
                and decode_rows < case["n"]
                and turn["mode"] in ("greedy", "sample", "beam")
                and takes_a_cache(case)  # else every generation step is a prefill (OpenAI GPT's): no decode to refuse
            ):
                rec.update(
                    outcome="fail",
                    detail=f"turn {t + 1}: decode='ring_pass_q' with {decode_rows} sequences "
                    f"< {case['n']} ranks ran instead of raising DecodeBatchError",
                )
                return rec
            rows = mine["tokens"].shape[0] if mine["tokens"] is not None else rows
        if ref_error is not None and not undefined_result(ref_error):
            # one process raised at the next turn (e.g. a cache of another batch size): ours must too
            try:
                next(turns)
            except Exception as e:
                rec["error_type"], rec["error_turn"] = type(e).__name__, rec["turns_compared"] + 1
                rec["detail"] = f"raised where the reference raised: {type(e).__name__}: {str(e)[:160]}"
            else:
                rec.update(
                    outcome="fail",
                    detail=f"turn {len(ref_turns) + 1}: the reference raised ({ref_error[:160]}), "
                    "the patched model returned a result",
                )
                return rec
        turns.close()
    except Exception as e:
        rec["error_type"], rec["error_turn"] = type(e).__name__, rec["turns_compared"] + 1
        if (
            not ref_turns
            and ref_error
            and ref_error.startswith(f"{type(e).__name__}: ")
            and not undefined_result(ref_error)
        ):
            # one process raised at its first turn, and so did we, from the same code: user code that fails under
            # one process's attention too (a forward patched to call SDPA on a softcapped model) fails at apply's probe
            rec["detail"] = f"raised what the reference raised: {type(e).__name__}: {str(e)[:160]}"
        elif expected_error(case, e, decode_rows, rec["turns_compared"]):
            rec.update(outcome="expected_error", detail=f"{type(e).__name__}: {str(e)[:200]}")
        else:
            tb = traceback.format_exc().strip().splitlines()
            rec.update(
                outcome="fail", detail=f"turn {rec['error_turn']}: {type(e).__name__}: {e}\n" + "\n".join(tb[-8:])
            )
    finally:
        rec["model"] = cp if cp is not None and hf_contextpar.get_runtime(cp) is not None else None
    return rec


def merge(case: dict, everyone: list[dict], ref_error: str | None) -> dict:
    """One record for the case from every rank's: the worst outcome, and whether the ranks stayed in step."""
    errors = {(r["error_type"], r["error_turn"]) for r in everyone}
    in_step = len(errors) == 1
    worst = next((r for r in everyone if r["outcome"] == "fail"), None) or everyone[0]
    outcome, detail = worst["outcome"], worst["detail"]
    if not in_step:
        outcome = "fail"
        detail = "ranks raised differently: " + "; ".join(
            f"rank {i}: {r['error_type'] or 'no error'} ({r['detail'].splitlines()[0][:160] if r['detail'] else r['outcome']})"
            for i, r in enumerate(everyone)
        )
    elif outcome != "fail":
        digests = [r["digests"] for r in everyone]
        if any(d != digests[0] for d in digests):
            outcome, detail = (
                "fail",
                "outputs differ between ranks: "
                + ", ".join(f"rank {i} turn digests {[x[:8] for x in d]}" for i, d in enumerate(digests)),
            )
    if (
        outcome in ("pass", "near_tie", "reference_nan")
        and everyone[0]["turns_compared"] == 0
        and not everyone[0]["error_type"]
    ):
        outcome = "skipped"
    if ref_error and outcome != "fail":
        detail = (
            detail + "; " if detail else ""
        ) + f"reference raised at turn {everyone[0]['turns_compared'] + 1}: {ref_error[:200]}"
    return dict(
        index=case["index"],
        outcome=outcome,
        detail=detail,
        in_step=in_step,
        turns_compared=everyone[0]["turns_compared"],
        case=case,
        description=describe(case),
        command=reproduce_command(case),
    )


def run_case(case: dict, rank: int) -> dict:
    box = [run_reference(case) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    ref_turns, ref_error = box[0]
    must_raise = ref_error is not None and not undefined_result(ref_error)  # turn 1 included
    if ref_turns or must_raise:
        mine = run_patched(case, ref_turns, ref_error)
    else:
        mine = dict(
            outcome="skipped", turns_compared=0, digests=[], detail="", error_type=None, error_turn=None, model=None
        )
    model = mine.pop("model")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    record = merge(case, everyone, ref_error)
    if model is not None and record["in_step"]:
        hf_contextpar.remove_context_parallel(model)  # frees the case's own gloo group and its sockets
    return record


# -- the loop ---------------------------------------------------------------------------------
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--seed",
        default=os.environ.get("HF_CONTEXTPAR_FUZZ_SEED", "0"),
        help="an integer, or 'random' to pick (and print) one",
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=float(os.environ.get("HF_CONTEXTPAR_FUZZ_SECONDS", "60")),
        help="time budget: no case starts after it (rank 0 decides)",
    )
    p.add_argument("--case", default=None, help="run exactly these case indices (comma-separated), no time budget")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a drawn parameter (VALUE is JSON, else a string), to reduce a failing case: "
        '--set rope=default --set \'turns=[{"mode": "greedy", "new_tokens": 4}]\'',
    )
    p.add_argument(
        "--where",
        default=None,
        metavar="EXPR",
        help="run only the drawn cases for which this Python expression of `case` is true, e.g. to keep "
        "fuzzing around a known bug: --where \"case['rope'] != 'dynamic'\"",
    )
    p.add_argument("--max-cases", type=int, default=None)
    p.add_argument("--out", default=None, help="directory for fuzz.json (rank 0)")
    args = p.parse_args(argv)

    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10 * CASE_TIMEOUT_S))
    rank, n = dist.get_rank(), dist.get_world_size()
    for family in OPTED_IN.values():  # what a user does to opt a family in
        if family["model_type"] not in REGISTRY:
            register(FamilyPatch(family["model_type"], "opted in by the fuzz test"))
    box = [random.SystemRandom().randrange(10**6) if args.seed == "random" else int(args.seed)]
    dist.broadcast_object_list(box, src=0)
    seed = box[0]
    if rank == 0:
        print(f"[fuzz N={n}] seed {seed} (HF_CONTEXTPAR_FUZZ_SEED={seed} reproduces this run)", flush=True)
    explicit = [int(x) for x in args.case.split(",")] if args.case else None
    indices = iter(explicit) if explicit is not None else iter(range(10**9))
    records, start, stop = [], time.monotonic(), False
    for index in indices:
        go = [
            not stop
            and (explicit is not None or time.monotonic() - start < args.seconds)
            and (args.max_cases is None or len(records) < args.max_cases)
        ]
        dist.broadcast_object_list(go, src=0)  # rank 0's clock decides for everyone
        if not go[0]:
            break
        case = draw_case(seed, n, index)
        if args.where and not eval(args.where, {}, dict(case=case)):
            continue
        for item in args.set:
            key, _, value = item.partition("=")
            try:
                case[key] = json.loads(value)
            except json.JSONDecodeError:
                case[key] = value
            case["overrides"] = case.get("overrides", "") + f" --set '{item}'"
        t0 = time.monotonic()
        record = run_case(case, rank)
        record["seconds"] = round(time.monotonic() - t0, 2)
        records.append(record)
        if not record["in_step"]:
            stop = True  # a rank failed while its peers waited: stop this launch
        if rank == 0:
            print(
                f"[fuzz N={n} seed={seed} case {index}] {record['outcome']} {record['seconds']}s {describe(case)}",
                flush=True,
            )
            if record["outcome"] == "fail":
                print(f"  FAILED: {record['detail']}\n  reproduce: {record['command']}", flush=True)
            elif record["detail"]:
                print(f"  {record['detail'].splitlines()[0][:300]}", flush=True)
            if args.out:
                os.makedirs(args.out, exist_ok=True)
                with open(os.path.join(args.out, "fuzz.json"), "w") as f:
                    json.dump(dict(seed=seed, n=n, finished=False, records=records), f, indent=1)
    failures = [r for r in records if r["outcome"] == "fail"]
    if rank == 0:
        counts = {
            o: sum(r["outcome"] == o for r in records)
            for o in ("pass", "expected_error", "near_tie", "reference_nan", "skipped", "fail")
        }
        print(
            f"[fuzz N={n} seed={seed}] {len(records)} cases in {time.monotonic() - start:.0f}s: {counts}"
            + (" (stopped after ranks fell out of step)" if stop else ""),
            flush=True,
        )
        for r in failures:
            print(
                f"  FAILED case {r['index']}: {r['detail'].splitlines()[0]}\n    {describe(r['case'])}\n"
                f"    reproduce: {r['command']}",
                flush=True,
            )
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "fuzz.json"), "w") as f:
                json.dump(dict(seed=seed, n=n, finished=True, records=records), f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
