"""Metrics for "does context parallelism change anything?": per generation and per teacher-forced
window. What counts as the same (tolerances, the near-tie rule, the kernel-swap bound) is the
oracle's (`oracle`)."""

from __future__ import annotations

import torch

from .oracle import first_divergence, logits_diff

__all__ = ["compare_generation", "step_logits_diff", "window_metrics"]


# -- generation --------------------------------------------------------------------------------
def step_logits_diff(ref: torch.Tensor, cp: torch.Tensor, steps: int) -> float:
    """Max |diff| over the first `steps` generated steps' logits ((S, V) each)."""
    steps = min(steps, ref.shape[0], cp.shape[0])
    if steps == 0:
        return 0.0
    return logits_diff(ref[:steps], cp[:steps])


def compare_generation(
    ref_tokens: torch.Tensor, ref_logits: torch.Tensor, cp_tokens: torch.Tensor, cp_logits: torch.Tensor
) -> dict:
    """Token identity, first divergence, and max logit diff over the steps both runs share a prefix for.

    After the first divergent token the two runs condition on different text, so their later
    logits are not comparable; the divergent step itself still is (same prefix), so it is included.
    `divergence_margin` is how much the reference preferred its own token over the context-parallel
    one at that step: within `oracle.near_tie`'s bound (twice the tolerance) the step was a near-tie
    that any change of summation order (a different attention kernel on one process, too) can flip.
    """
    div = first_divergence(ref_tokens[None], cp_tokens[None])
    steps = ref_tokens.numel() if div is None else div + 1
    margin = None
    if div is not None and div < min(ref_tokens.numel(), cp_tokens.numel(), ref_logits.shape[0]):
        row = ref_logits[div].double()
        margin = float(row[ref_tokens[div]] - row[cp_tokens[div]])
    return dict(
        tokens_identical=div is None,
        first_divergence=div,
        max_logit_diff=step_logits_diff(ref_logits, cp_logits, steps),
        steps_compared=min(steps, ref_logits.shape[0], cp_logits.shape[0]),
        divergence_margin=margin,
    )


# -- teacher forcing ---------------------------------------------------------------------------
def window_metrics(ref_logits: torch.Tensor, cp_logits: torch.Tensor, ids: torch.Tensor, rows: int = 512) -> dict:
    """Per window ((T, V) logits, (T,) ids): max |logit diff|, max |NLL diff| per predicted token,
    perplexity both ways, argmax agreement. Computed in fp64, `rows` positions at a time so a long
    window with a large vocabulary needs no (T, V) fp64 copy."""
    if ref_logits.shape != cp_logits.shape:
        raise ValueError(f"logit shapes differ: {tuple(ref_logits.shape)} vs {tuple(cp_logits.shape)}")
    T = ref_logits.shape[0]
    max_diff, max_nll, agree = 0.0, 0.0, 0
    nll_ref = torch.zeros((), dtype=torch.float64)
    nll_cp = torch.zeros((), dtype=torch.float64)
    for s in range(0, T, rows):
        a = ref_logits[s : s + rows].double()
        b = cp_logits[s : s + rows].to(a.device).double()
        max_diff = max(max_diff, float((a - b).abs().max()))
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        n = min(s + rows, T - 1) - s  # positions in this chunk that predict a next token
        if n > 0:
            target = ids[s + 1 : s + 1 + n].to(a.device)[:, None]
            la = -torch.log_softmax(a[:n], -1).gather(1, target).squeeze(1)
            lb = -torch.log_softmax(b[:n], -1).gather(1, target).squeeze(1)
            max_nll = max(max_nll, float((la - lb).abs().max()))
            nll_ref += la.sum().cpu()
            nll_cp += lb.sum().cpu()
    predicted = max(T - 1, 1)
    return dict(
        max_logit_diff=max_diff,
        max_nll_diff=max_nll,
        ppl_ref=float(torch.exp(nll_ref / predicted)),
        ppl_cp=float(torch.exp(nll_cp / predicted)),
        argmax_agreement=agree / T,
    )
