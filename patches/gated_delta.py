"""Gated DeltaNet's chunked scan, split so that a chained rank waits for the passed state only where it is used.

transformers' `torch_chunk_gated_delta_rule` (Qwen3-Next, Qwen3.5, OLMo-hybrid, LaraMini, Qwen4-Exp: one
copy per modeling module) does most of its work before it reads the initial state: the per-chunk UT
transform (two triangular solves), the intra-chunk attention and the decays. Only the scan over chunks
reads it. A chained rank (cache/recurrent.py) would otherwise wait for rank - 1's whole layer at the
layer's start: the chain's lag between ranks would be a whole mixer. Here the mixer runs inside
`takes_state_late`, its cache read of a state still on its way returns None, and the kernel below runs
the state-free part first, then takes the state (`deferred_state`) for the scan. The lag is the scan.
A mixer's forward or kernel replaced after `apply` (a user's own) reads and gets the state as before.

`prepare` and `scan` are transformers' kernel cut in two, the same operations in the same order, so a
split run equals the original bit for bit (tests/unit/test_recurrent.py checks it against each modeling
module's own). Where the modeling module runs another implementation (flash-linear-attention, a hub
kernel), the state is taken first and that implementation runs as it is.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import weakref

import torch
import torch.nn.functional as F

from hf_contextpar.cache.recurrent import deferred_state, takes_state_late

from .wrapping import install

KERNEL = "torch_chunk_gated_delta_rule"
_LATE_KERNELS = weakref.WeakSet()  # the wrapped kernels: a mixer hands its state late to these alone


def prepare(query, key, value, g, beta, chunk_size=64, use_qk_l2norm_in_kernel=False):
    """The state-free part of transformers' kernel, up to the scan over chunks."""
    batch_size, sequence_length, num_k_heads, k_head_dim = key.shape
    num_v_heads, v_head_dim = value.shape[-2:]
    if num_k_heads != num_v_heads:
        query = query.repeat_interleave(num_v_heads // num_k_heads, dim=2)
        key = key.repeat_interleave(num_v_heads // num_k_heads, dim=2)
    query, key, value, beta, decay = [
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for x in (query, key, value, beta, g)
    ]
    if use_qk_l2norm_in_kernel:
        query = _l2norm(query)
        key = _l2norm(key)
    query = query * query.shape[-1] ** -0.5
    pad_size = (chunk_size - sequence_length % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad_size)) for x in (query, key, value))
    beta, decay = (F.pad(x, (0, pad_size)) for x in (beta, decay))
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = [
        x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1]) for x in (query, key, k_beta, v_beta)
    ]
    decay = decay.reshape(decay.shape[0], decay.shape[1], -1, chunk_size)
    strictly_upper_mask = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    cum_decay = decay.cumsum(dim=3)
    pairwise_decay = cum_decay.unsqueeze(4) - cum_decay.unsqueeze(3)
    pairwise_decay = pairwise_decay.masked_fill(strictly_upper_mask, float("-inf")).exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise_decay
    intra_chunk_attn = (query @ key.transpose(-1, -2)) * pairwise_decay
    decayed_k_beta = k_beta * cum_decay.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)
    query = query * cum_decay.exp().unsqueeze(-1)
    key = key * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)
    chunk_decay = cum_decay[..., -1].exp()[..., None, None]
    shape = (batch_size, num_v_heads, k_head_dim, v_head_dim), sequence_length
    return shape, query, key, new_values, k_cumdecay, intra_chunk_attn, chunk_decay


def scan(prepared, initial_state, output_final_state, dtype):
    """The scan over chunks from `initial_state` (None: zero), as transformers' kernel ends."""
    (state_shape, sequence_length), query, key, new_values, k_cumdecay, intra_chunk_attn, chunk_decay = prepared
    if initial_state is None:
        state = torch.zeros(state_shape, dtype=new_values.dtype, device=new_values.device)
    else:
        state = initial_state.to(new_values)
    out = torch.zeros_like(new_values)
    for i in range(new_values.shape[2]):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = query[:, :, i] @ state + intra_chunk_attn[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(state_shape[0], state_shape[1], -1, state_shape[3])[:, :, :sequence_length]
    out = out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)
    return out, (state if output_final_state else None)


def _l2norm(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _runs_torch(kernel) -> bool:
    """Whether the modeling module's kernel (transformers' hub wrapper) runs its torch reference."""
    try:
        return inspect.getclosurevars(kernel).nonlocals.get("is_new_implementation") is False
    except TypeError:
        return False


def _late(kernel):
    torch_path = _runs_torch(kernel)
    signature = inspect.signature(kernel)
    params = signature.parameters

    def torch_chunk_gated_delta_rule(*args, **kwargs):
        take = deferred_state()
        if take is None:
            return kernel(*args, **kwargs)
        bound = signature.bind(*args, **kwargs).arguments
        packed = kwargs.get("cu_seqlens") is not None or kwargs.get("seq_idx") is not None
        if not torch_path or packed:
            kwargs["initial_state"] = take()
            return kernel(*args, **kwargs)
        get = lambda name: bound.get(name, params[name].default)  # noqa: E731
        names = ("query", "key", "value", "g", "beta", "chunk_size", "use_qk_l2norm_in_kernel")
        prepared = prepare(*(get(n) for n in names))
        return scan(prepared, take(), get("output_final_state"), get("query").dtype)

    torch_chunk_gated_delta_rule.__wrapped__ = kernel
    _LATE_KERNELS.add(torch_chunk_gated_delta_rule)
    return torch_chunk_gated_delta_rule


def _mixer(forward):
    calls = inspect.unwrap(forward).__globals__  # where the forward's code finds the kernel it calls

    def forward_taking_state_late(self, *args, **kwargs):
        # a kernel put in after apply (the user's own, even one wrapping ours) is handed the state as the mixer reads it
        late = calls.get(KERNEL) in _LATE_KERNELS
        with takes_state_late() if late else contextlib.nullcontext():
            return forward(self, *args, **kwargs)

    forward_taking_state_late.__wrapped__ = forward  # a second model's apply finds the forward's code and counts
    return forward_taking_state_late


def apply(model):
    """Wrap the chunked kernel of each modeling module whose mixers call it, and those mixers' forwards (the ones
    whose code calls it by that name: a forward replaced by other code reads its state as before); returns undo()."""
    undos = []
    for mixer in {type(m) for m in model.modules()}:
        module = sys.modules[mixer.__module__]
        code = getattr(inspect.unwrap(mixer.forward), "__code__", None)  # under transformers' decorators
        if code is not None and KERNEL in code.co_names and hasattr(module, KERNEL):
            undos += [install(module, KERNEL, _late), install(mixer, "forward", _mixer)]

    def undo():
        for u in reversed(undos):
            u()

    return undo
