"""Mamba1's scan (mamba, falcon_mamba, jamba, zamba), continued from the state the chain passed.

transformers' Mamba1 mixers run every multi-token forward from a zero SSM state ("initial hidden
state is not supported by the kernel path"), so a chained rank's partition would start from nothing.
A linear recurrence h_t = dA_t h_(t-1) + dB_t x_t started from h0 is the zero-started one plus
P_t h0, where P_t = dA_1 ... dA_t = exp(A (dt_1 + ... + dt_t)); the output adds C_t P_t h0 (gated
like the rest), the last state P_T h0. This patch wraps the family module's `mamba_selective_scan`
so that, inside a chained forward only, a rank adds the contribution of the state it received for
the running layer. Everything else (a first rank, a forward over a cache on one process, which starts
from zero too, decode's one-token update) runs transformers' scan untouched.
"""

from __future__ import annotations

import sys
from contextvars import ContextVar

import torch
import torch.nn.functional as F

from hf_contextpar.cache.recurrent import received_state
from hf_contextpar.errors import PatchStateError, UnsupportedInputError
from hf_contextpar.model.families import FamilyHooks

from .wrapping import install

# Zamba's mixer splits its channels into n_mamba_heads and scans each head apart, in head order, from one state
# (batch, heads, head_dim, d_state): while such a mixer runs, the index of its next head's scan
_head: ContextVar = ContextVar("hf_contextpar_mamba1_head", default=None)


def _continued(scan):
    def mamba_selective_scan(
        hidden_states,
        dt,
        A,
        B,
        C,
        D=None,
        z=None,
        delta_bias=None,
        delta_softplus=False,
        return_last_state=False,
        **kwargs,
    ):
        h0 = received_state()  # (batch, intermediate, state), Zamba's (batch, heads, head_dim, state), or None
        if h0 is not None and h0.dim() == 4:
            head = _head.get()
            if head is None or head[0] >= h0.shape[1]:
                raise PatchStateError(
                    f"a Mamba1 scan received a per-head state {tuple(h0.shape)} outside its mixer's head loop: this "
                    "model splits its scan otherwise than Zamba's mixer does. Please report this model."
                )
            h0, head[0] = h0[:, head[0]], head[0] + 1
        args = (hidden_states, dt, A, B, C, D, z, delta_bias, delta_softplus)
        if h0 is None:
            return scan(*args, return_last_state=return_last_state, **kwargs)
        out, last = scan(*args, return_last_state=True, **kwargs)
        if delta_bias is not None:
            dt = dt + delta_bias.to(dt.dtype)[..., None]
        if delta_softplus:
            dt = F.softplus(dt)
        decay = torch.exp(A[None, :, None, :] * dt.cumsum(-1)[..., None])  # (batch, intermediate, T, state)
        extra = torch.einsum("bdtn,bdn,bnt->bdt", decay, h0.to(decay.dtype), C.to(decay.dtype))
        if z is not None:
            extra = extra * F.silu(z)
        out = out + extra.to(out.dtype)
        last = last + (decay[:, :, -1] * h0.to(decay.dtype)).to(last.dtype)
        return (out, last) if return_last_state else out

    return mamba_selective_scan


def _head_loop(forward):
    def mixer_forward(self, *args, **kwargs):
        token = _head.set([0])  # its scans run head 0, 1, ... in order
        try:
            return forward(self, *args, **kwargs)
        finally:
            _head.reset(token)

    return mixer_forward


def apply(model):
    """Wrap the scan of the model's modeling module, and the forward of a mixer that scans per head (Zamba's
    n_mamba_heads); returns undo()."""
    module = sys.modules[type(model.get_decoder()).__module__]
    undos = [install(module, "mamba_selective_scan", _continued)]
    for mixer in {type(m) for m in model.modules() if hasattr(m, "n_mamba_heads")}:
        undos.append(install(mixer, "forward", _head_loop))

    def undo():
        for u in undos:
            u()

    return undo


class MaskedInput(FamilyHooks):
    """Mamba and Falcon-Mamba multiply their hidden states by the 2D attention_mask as given: the mask needs one
    column per input token (on one process another width fails or broadcasts the input), and a chained rank's
    forward gets its own tokens' columns alone."""

    def check_mask(self, model, mask, num_new: int) -> None:
        if mask.shape[-1] != num_new:
            raise UnsupportedInputError(
                f"attention_mask has {mask.shape[-1]} columns for {num_new} input tokens: {type(model).__name__} "
                "multiplies its hidden states by the mask as given, so it needs one column per input token (on "
                "one process another width fails or broadcasts the input). Pass the new tokens' mask, or none."
            )

    def chained_mask(self, mask, start: int, end: int):
        return mask[:, start:end]


MASKED_INPUT = MaskedInput()
