"""The exactness oracle: what "the context-parallel model is the stock model" means, in one place.

Everything that compares a context-parallel run with the unpatched single process reads it from
here: the eval harness (`hf_contextpar.eval`), the self-test (`hf_contextpar selftest`), the fuzz
test and the exactness / geometry matrices (tests/).

- **Tolerance** on max |logit diff| (`tolerance`, `logit_tolerance`): fp64 1e-10, or the family's
  `FamilyPatch.fp64_tolerance` where transformers' own fp64 reference is fp32-limited (Gemma2's
  eager softmax: 1e-5); fp32 1e-4, or the family's `FamilyPatch.fp32_tolerance` where the unpatched
  fp32 model is itself about that far from its fp64 self (Gemma 4's 512-wide heads: 3e-4). Far above what a reordered sum costs, far below what a wrong
  mask or a missing block costs. Where a caller measures it (`fp32_self_error`: the unpatched fp32
  model against the same weights in fp64), the fp32 bound is the model's own: `fp32_bound`, twice that
  error rounded up to one significant digit, at least 1e-4, in place of the family's fixed exception.
  fp64 where the model computes parts in fp32 on purpose (a hybrid's scans, an MoE router): where a caller
  measures it on the prompt in question (`internals_error`: the forward as it runs against the same with those
  parts in fp64, `Fp64Internals`), twice that error where it is wider than the family's bound (the census
  measured those on a 61-token prompt; the error grows with the prompt).
  bf16/fp16: the **kernel-swap bound** (`kernel_swap_bound`), what
  swapping the unpatched model's attention kernel between eager and SDPA alone changes
  (`kernel_swap`), with a floor of 1e-2.
- **Near-tie rule** (`near_tie`): a generated token may differ from the reference's only at a step
  where the reference's margin (its top-2 logits, `top2_margin`; the harness: its token over ours)
  is at most `NEAR_TIE_FACTOR` x the tolerance, with every earlier logit within tolerance; after it
  the runs condition on different text and are not compared.
- **Digests** (`digest`): bit-exact fingerprints of a run's outputs, compared between ranks (every
  rank must return the same bytes); `fingerprint`: a prompt's ids (saved references).

Light on purpose: torch and the family registry only.
"""

from __future__ import annotations

import copy
import hashlib
import math
from contextlib import contextmanager

import torch
from hf_contextpar.patches import REGISTRY
from torch.overrides import TorchFunctionMode

# -- tolerances -------------------------------------------------------------------------------
FLOAT_TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
LOW_PRECISION_FLOOR = 1e-2
NEAR_TIE_FACTOR = 2.0


def _dtype(dtype) -> torch.dtype:
    """A torch dtype from a dtype or its name ("float64", "bfloat16")."""
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def kernel_swap_bound(kernel_swap: float | None) -> float:
    """The bf16/fp16 tolerance: what a kernel swap alone changes (None: not measurable), at least the floor."""
    return max(kernel_swap if kernel_swap is not None else 0.0, LOW_PRECISION_FLOOR)


def fp32_bound(self_error: float) -> float:
    """The fp32 tolerance of a model whose own fp32 forward is `self_error` from its fp64 self: twice that,
    rounded up to one significant digit (Gemma 4's 1.3e-4 gives 3e-4), never below the fixed 1e-4."""
    fixed = FLOAT_TOL[torch.float32]
    if not self_error > 0:
        return fixed
    return max(fixed, _twice(self_error))


def _twice(error: float) -> float:
    """Twice `error`, rounded up to one significant digit."""
    twice = 2 * error
    exp = math.floor(math.log10(twice))
    return float(f"{math.ceil(round(twice / 10.0**exp, 9))}e{exp}")


def fp32_self_error(model, ids: torch.Tensor) -> float:
    """Max |logit diff| between the unpatched fp32 `model` and the same weights in fp64 on `ids`: how far the
    model's own fp32 arithmetic is from exact (wide heads, long sums); a context-parallel run, which reorders
    those sums, cannot be held closer than that. The model is left as it was."""
    twin = copy.deepcopy(model).to(torch.float64)
    with torch.no_grad():
        return logits_diff(model(ids).logits, twin(ids).logits)


# -- the model's own fp32 arithmetic inside an fp64 forward ----------------------------------------
_CASTS = {torch.Tensor.to, torch.Tensor.float, torch.Tensor.type}
_SOFTMAX = {torch.nn.functional.softmax, torch.softmax, torch.Tensor.softmax, torch.nn.functional.log_softmax}


class Fp64Internals(TorchFunctionMode):
    """Inside: a cast of an fp64 tensor to fp32 returns the tensor, a softmax asked for fp32 of fp64 input
    computes in fp64, and fp32 tensors meeting fp64 ones in one call are promoted: the model's deliberate
    fp32 computations run in fp64. For measurement only."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _SOFTMAX and kwargs.get("dtype") == torch.float32 and _is64(args[0] if args else None):
            kwargs["dtype"] = torch.float64
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if any(t.dtype == torch.float64 for t in tensors):  # positional or keyword (layer_norm's weight=, bias=)
            args = tuple(_promoted(a) for a in args)
            kwargs = {k: _promoted(v) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        if func in _CASTS and _is64(args[0]) and isinstance(out, torch.Tensor) and out.dtype == torch.float32:
            return args[0] if out.device == args[0].device else out.double()
        return out


def _promoted(a):
    return a.double() if isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a


def _is64(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.float64


def internals_error(model, ids: torch.Tensor) -> float:
    """Max |logit diff| between the unpatched fp64 `model` as it runs (the fp32 parts it computes on purpose:
    a hybrid's chunked scans and gates, an MoE router) and the same forward with those parts in fp64
    (`Fp64Internals`), on `ids`: it grows with the prompt (Qwen3-Next's tiny hybrid: 4e-5 at 60 tokens, 7e-4 at
    240), so it is measured on the prompt in question. The model is left as it was."""
    with torch.no_grad():
        plain = model(ids).logits
        with Fp64Internals():
            inside = model(ids).logits
    return logits_diff(plain, inside)


def tolerance(
    dtype,
    model_type: str = "",
    kernel_swap: float | None = None,
    fp32_error: float | None = None,
    internals_error: float | None = None,
) -> tuple[float, str]:
    """(max |logit diff| allowed, how it was chosen) for a model of `dtype` (a torch dtype or its name)
    and `config.model_type`; `kernel_swap` is the measured kernel swap (low precision only), `fp32_error`
    the model's measured `fp32_self_error` (fp32 only: it replaces the family's fixed bound), `internals_error`
    the model's measured `internals_error` on the prompt in question (fp64 only: twice it, where that is wider
    than the family's bound, which the census measured on a short prompt)."""
    dtype = _dtype(dtype)
    if dtype == torch.float64 and internals_error is not None and internals_error > FLOAT_TOL[dtype]:
        family = REGISTRY.get(model_type)
        fixed = family.fp64_tolerance if family is not None else FLOAT_TOL[dtype]
        bound = max(fixed, _twice(internals_error))
        return bound, f"fp64, twice the model's own fp32-internals error {internals_error:.2g} on this prompt"
    if dtype == torch.float32 and fp32_error is not None:
        bound = fp32_bound(fp32_error)
        return bound, f"fp32, max(twice the model's own fp32-vs-fp64 error {fp32_error:.2g}, 1e-4)"
    if dtype in FLOAT_TOL:
        family = REGISTRY.get(model_type)
        if dtype == torch.float64 and family is not None and family.fp64_tolerance != FLOAT_TOL[dtype]:
            return family.fp64_tolerance, f"fp64, {model_type} (transformers' own reference is fp32-limited)"
        if dtype == torch.float32 and family is not None and family.fp32_tolerance != FLOAT_TOL[dtype]:
            return family.fp32_tolerance, f"fp32, {model_type} (its own fp32 forward is that far from fp64)"
        return FLOAT_TOL[dtype], f"{str(dtype).split('.')[-1]} fixed tolerance"
    ks = kernel_swap if kernel_swap is not None else 0.0
    return kernel_swap_bound(kernel_swap), f"max(attention kernel swap {ks:.3g}, floor {LOW_PRECISION_FLOOR:g})"


def _short(x: float) -> str:
    return f"{x:.0e}".replace("e-0", "e-")  # 1e-5, 1e-10


def describe_tolerances(swap_on: str = "") -> str:
    """The rules of `tolerance` in words (the harness's --help), read from the same numbers."""
    wider = ", ".join(
        f"{p.description.split(':')[0]} {_short(p.fp64_tolerance)}"
        for p in REGISTRY.values()
        if p.fp64_tolerance != FLOAT_TOL[torch.float64]
    )
    return (
        f"float64 {_short(FLOAT_TOL[torch.float64])}{f' ({wider})' if wider else ''}, "
        f"float32 {_short(FLOAT_TOL[torch.float32])}, bfloat16/float16 max(the diff that switching the unpatched "
        f"model between eager and SDPA attention causes{swap_on}, {_short(LOW_PRECISION_FLOOR)})"
    )


def logit_tolerance(model_type: str, dtype, kernel_swap: float | None = None, fp32_error: float | None = None) -> float:
    """`tolerance`'s number alone."""
    return tolerance(dtype, model_type, kernel_swap, fp32_error)[0]


# -- the near-tie rule ------------------------------------------------------------------------
def top2_margin(row: torch.Tensor) -> float:
    """How much the best of a (V,) logit row beats the second best."""
    top = row.double().topk(2).values
    return float(top[0] - top[1])


def near_tie(margin: float | None, tol: float) -> bool:
    """Is a token divergence at a step with this reference margin a near-tie (any change of summation
    order, a kernel swap on one process too, can flip it)?"""
    return margin is not None and margin <= NEAR_TIE_FACTOR * tol


# -- differences ------------------------------------------------------------------------------
def logits_diff(a: torch.Tensor, b: torch.Tensor, attention_mask: torch.Tensor | None = None) -> float:
    """Max |a - b| over (B, T, V) logits, ignoring padded positions (their values are kernel-specific)."""
    if a.shape != b.shape:
        raise ValueError(f"logit shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    d = (a.double() - b.double()).abs()
    if attention_mask is not None:
        d = d[attention_mask.bool()[:, -a.shape[1] :]]
    return float(d.max()) if d.numel() else 0.0


def first_divergence(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """First sequence index where token tensors (B, T) differ in any row, or None if identical."""
    if a.shape != b.shape:
        return min(a.shape[-1], b.shape[-1])
    diff = (a != b).any(dim=0).nonzero()
    return int(diff[0]) if diff.numel() else None


# -- the kernel swap --------------------------------------------------------------------------
@contextmanager
def other_attention_kernel(model):
    """The unpatched model with the other of eager / SDPA attention inside the block (yields True),
    restored after; yields False, changing nothing, where the model has no other kernel."""
    original = model.config._attn_implementation
    try:
        model.set_attn_implementation("sdpa" if original == "eager" else "eager")
    except (ValueError, ImportError):
        yield False
        return
    try:
        yield True
    finally:
        model.set_attn_implementation(original)


def kernel_swap(model, ids: torch.Tensor) -> float | None:
    """Max |logit diff| of the unpatched model between its attention kernel and the other of eager/SDPA:
    what a kernel change alone moves low-precision logits by (the bf16/fp16 tolerance)."""
    with torch.no_grad():
        a = model(ids).logits
        with other_attention_kernel(model) as swapped:
            if not swapped:
                return None
            b = model(ids).logits
    return logits_diff(a, b)


# -- digests ----------------------------------------------------------------------------------
def digest(tensors) -> str:
    """sha1 of the tensors' bytes, in order (None skipped; half types widened to fp32): equal exactly
    when every tensor is bitwise equal."""
    h = hashlib.sha1()
    for t in tensors:
        if t is None:
            continue
        t = t.detach().cpu().contiguous()
        if t.dtype in (torch.bfloat16, torch.float16):  # numpy has no bf16
            t = t.float()
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def fingerprint(ids) -> str:
    """A prompt's fingerprint (a saved reference's `prompt_sha`: keep it stable)."""
    return hashlib.sha1(torch.as_tensor(ids, dtype=torch.long).numpy().tobytes()).hexdigest()[:16]
