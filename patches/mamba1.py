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

import torch
import torch.nn.functional as F

from hf_contextpar.cache.recurrent import received_state

_installed: dict = {}  # module -> [original scan, models patched]


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
        h0 = received_state()  # (batch, intermediate, state) or None
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


def apply(model):
    """Wrap the scan of the model's modeling module (once per module, counted); returns undo()."""
    module = sys.modules[type(model.get_decoder()).__module__]
    entry = _installed.setdefault(module, [module.mamba_selective_scan, 0])
    if entry[1] == 0:
        module.mamba_selective_scan = _continued(entry[0])
    entry[1] += 1

    def undo():
        entry[1] -= 1
        if entry[1] == 0:
            module.mamba_selective_scan = entry[0]
            del _installed[module]

    return undo
