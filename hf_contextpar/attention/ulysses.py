"""Ulysses-style head all-to-all (CSPS SP-NTP, 3.2.1; DeepSpeed-Ulysses).

Q and this forward's K/V arrive sharded by sequence. One all-to-all turns them into shards by
head: rank j gets every token of query heads [j H/N, (j+1) H/N) and of the matching KV heads
[j H_kv/N, (j+1) H_kv/N) (GQA groups stay whole; KV heads are sent as stored, never repeated).
With every column in hand, the rows are put in global order and one causal attention runs over
the whole sequence; a second all-to-all sends each rank its tokens' outputs for all heads.
Needs N to divide both H and H_kv: checked by apply_context_parallel on the heads a probe forward sees, and here
on the heads the attention gets (a family patch may hand it fewer: JetMoE's K/V before its repeat). No LSE merge: each head
sees all its keys at once, so no LSE is returned and attention sinks (of this rank's heads) are
applied here, before the outputs go back.

This file is the whole-heads capability's one room (a strategy record with `whole_heads`: Ulysses): what it refuses
at apply (`check`: DCP, an MLA latent, heads N does not divide; `check_ulysses` on a config alone) and per layer
(`check_expansion`: an expansion that mixes the KV heads; `ulysses`: the heads a layer's attention gets).
"""

from __future__ import annotations

import torch

from ..config import config_value
from ..errors import HeadsNotDivisibleError
from ..mesh import heads_per_rank
from ..plan.costmodel import ulysses_fits
from ..plan.strategies import STRATEGIES
from .latent import latent_modules


def check(facts) -> bool:
    """At apply (capabilities.py): does the forward move whole heads (a strategy asked for that does), after refusing
    what it cannot split by head: a KV head DCP shares by sequence, an MLA latent (one for all heads, which expanding
    first would send as the per-head K/V MLA exists to avoid), and heads the ranks do not divide (the heads this
    rank's attention receives under TP, not the config's: dbrx)."""
    settings = facts.settings
    if settings.strategy == "auto" or not STRATEGIES[settings.strategy].whole_heads:
        return False
    if facts.dcp is not None:
        raise HeadsNotDivisibleError(
            f"strategy='ulysses' splits the KV heads over the context-parallel ranks, and each rank holds one KV "
            f"head here, shared with {facts.dcp[2] - 1} other TP rank(s) by sequence (DCP): use another strategy."
        )
    modules = latent_modules(facts.model)
    if modules:
        raise HeadsNotDivisibleError(
            f"{type(modules[0]).__name__} caches one latent for all heads (MLA), which strategy='ulysses' cannot "
            "split by head: use strategy='auto' or any ring strategy."
        )
    shape = facts.shape
    check_ulysses(
        facts.config, facts.world, (shape.heads, shape.kv_heads) if facts.tp > 1 else heads_per_rank(facts.model)
    )
    return True


def check_ulysses(config, world: int, held: tuple[int, int] | None = None):
    """Ulysses moves whole heads: N must divide the query heads and the KV heads each rank holds (no KV
    head is repeated). held: (query heads, KV heads) this rank's attention receives (the runtime reads them:
    under tensor parallelism, and in families whose config counts differ, e.g. dbrx); without it the
    config's counts, and a model transformers loaded with tp > 1 (config.distributed_config) is left to that."""
    text = config.get_text_config(decoder=True)
    heads = config_value(text, "num_attention_heads")
    if heads is None:  # no attention layer at all (Mamba2): no head to split, nothing for Ulysses to do
        return
    kv_heads = config_value(text, "num_key_value_heads") or heads
    if held is None and (getattr(getattr(config, "distributed_config", None), "tp_size", None) or 1) > 1:
        return
    if held is not None:
        heads, kv_heads = held
    if heads == 0 or kv_heads == 0 or not ulysses_fits(heads, kv_heads, world):
        each = " in each rank's attention" if held is not None else ""
        raise HeadsNotDivisibleError(
            f"strategy='ulysses' splits attention heads over the {world} ranks, but this model has {heads} query "
            f"heads and {kv_heads} KV heads{each}, which {world} does not divide. Use strategy='ring_pass_kv' (or "
            f"any other strategy), or a number of processes that divides {kv_heads}."
        )


def check_expansion(algorithm: str, module) -> None:
    """A layer attending with an expansion of its cached K/V (attention/latent.py's `expand_kv`) over all its KV
    heads (DiffLlama's puts both value halves side by side, mixing the heads): a strategy that splits the KV heads
    between ranks cannot compute it."""
    if STRATEGIES[algorithm].whole_heads:
        raise HeadsNotDivisibleError(
            f"{type(module).__name__} (layer {module.layer_idx}) attends with an expansion of its cached K/V over all "
            f"its KV heads (expand_kv), which the {algorithm!r} strategy, splitting the KV heads between ranks, "
            "cannot compute: use strategy='auto' or any ring strategy."
        )


def check_bias(algorithm: str, module, bias_fn) -> None:
    """A score bias computed from each key's values over all its KV heads (a per-key bias that reads them whole): a
    strategy that splits the KV heads between ranks does not hold them."""
    if getattr(bias_fn, "reads_values", False) and STRATEGIES[algorithm].whole_heads:
        raise HeadsNotDivisibleError(
            f"{type(module).__name__}'s score bias is computed from each key's values over all its KV heads, which the "
            f"{algorithm!r} strategy, splitting the KV heads between ranks, does not hold: use strategy='auto' or any "
            "ring strategy."
        )


def ulysses(step, q, kv_local, **attn):
    from .kernels import attend
    from .merge import with_sink

    comm, world = step.comm, step.comm.world
    b, h, t, d = step.out_shape(q)  # d: the output's head size (the values')
    if h % world or kv_local.shape[2] % world:  # the same shapes on every rank: all raise, before any message
        raise HeadsNotDivisibleError(
            f"strategy='ulysses' splits attention heads over the {world} ranks, but layer {step.layer}'s attention "
            f"gets {h} query heads and {kv_local.shape[2]} KV heads, which {world} does not divide. Use "
            "strategy='ring_pass_kv' (or any other strategy), or a number of processes that divides both."
        )
    hq, hk = h // world, kv_local.shape[2] // world
    q_sizes = [c.numel() for c in step.q_cols_all]
    kv_sizes = [c.numel() for c in step.kv_cols]
    # sequence-sharded -> head-sharded
    qs = comm.all_to_all(
        [q[:, j * hq : (j + 1) * hq] for j in range(world)], [(b, hq, n, q.shape[-1]) for n in q_sizes]
    )
    kvs = comm.all_to_all(
        [kv_local[:, :, j * hk : (j + 1) * hk] for j in range(world)],
        [(kv_local.shape[0], b, hk, n, kv_local.shape[-1]) for n in kv_sizes],
    )
    q_cols, q_order = torch.cat(step.q_cols_all).sort()
    k_cols, k_order = torch.cat(step.kv_cols).sort()
    qh = torch.cat(qs, dim=2).index_select(2, q_order.to(q.device))
    k, v = step.unpack(torch.cat(kvs, dim=3).index_select(3, k_order.to(q.device)), None)
    key_valid = step.padding[:, k_cols.to(step.padding.device)] if step.padding is not None else None
    if attn.get("bias") is not None:  # a score bias per head (ALiBi): this rank's heads'
        attn = {**attn, "bias": attn["bias"].head_slice(comm.rank * hq, (comm.rank + 1) * hq)}
    res = attend(qh, k, v, q_cols, k_cols, key_valid=key_valid, **attn)
    if res is None:
        out = qh.new_zeros(step.out_shape(qh), dtype=torch.float32)
    else:
        out = res[0] if step.sinks is None else with_sink(*res, step.sinks[comm.rank * hq : (comm.rank + 1) * hq])
    # head-sharded -> sequence-sharded: rank i gets its own tokens back, for our heads
    out = out[..., :d].to(q.dtype).index_select(2, q_order.argsort().to(q.device))
    back = comm.all_to_all(list(out.split(q_sizes, dim=2)), [(b, hq, t, d)] * world)
    return torch.cat(back, dim=1), None
