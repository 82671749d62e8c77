"""A recurrent cache layer's states: what it holds, their wire format, and the final states' broadcast.

transformers' recurrent cache layers (`LinearAttentionCacheLayerMixin`) hold conv and recurrent states
per state index. The state chain (recurrent.py) sends them down the ranks as a fixed-size int64 header
describing them, then their bytes in one buffer; after a chained prefill every rank takes the last
partition's states (`share_final_states`), so that decode runs every recurrent layer on every rank.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from ..errors import UnsupportedModelError
from .layers import ChainedLayer

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_MAX_DIMS = 6
_FIELDS = 4 + _MAX_DIMS  # per state: kind (0 conv, 1 recurrent), state index, dtype, ndim, dims
_MAX_STATES = 8
HEADER = 3 + _FIELDS * _MAX_STATES  # states, payload bytes, 1 if the layer's other states follow, the states' fields


def is_recurrent(layer) -> bool:
    """A transformers cache layer that holds conv / recurrent states (also hybrid ones that hold K/V too)."""
    return isinstance(layer, LinearAttentionCacheLayerMixin)


def layer_states(layer) -> dict[tuple[int, int], torch.Tensor]:
    """{(kind, state index): tensor} of what a recurrent cache layer holds (kind 0: conv, 1: recurrent)."""
    out = {}
    for i in range(layer.number_of_states):
        if layer.is_conv_states_initialized[i]:
            out[0, i] = layer.conv_states[i]
        if layer.is_recurrent_states_initialized[i]:
            out[1, i] = layer.recurrent_states[i]
    return out


def load_states(layer, states: dict[tuple[int, int], torch.Tensor]) -> None:
    """Make a recurrent cache layer hold `states` as the state before its next tokens."""
    for (kind, i), t in states.items():
        if kind == 0:
            layer.conv_states[i] = t
            layer.conv_kernel_size[i] = t.shape[-1]
            layer.is_conv_states_initialized[i] = True
        else:
            layer.recurrent_states[i] = t
            layer.is_recurrent_states_initialized[i] = True
        layer.has_previous_state[i] = True
        if layer.device is None:
            layer.dtype, layer.device = t.dtype, t.device


def pack(states: dict[tuple[int, int], torch.Tensor], device, more: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload): a fixed-size int64 header describing the states, and their bytes in one buffer.
    more: the layer's other states follow in a second message."""
    if len(states) > _MAX_STATES or any(t.dim() > _MAX_DIMS or t.dtype not in _DTYPES for t in states.values()):
        raise UnsupportedModelError(
            f"a recurrent layer's cached states {[(tuple(t.shape), t.dtype) for t in states.values()]} do not fit "
            f"the state chain's header (at most {_MAX_STATES} states of {_MAX_DIMS} dimensions in {_DTYPES})."
        )
    header = torch.zeros(HEADER, dtype=torch.long)
    parts = []
    for n, ((kind, i), t) in enumerate(sorted(states.items())):
        fields = [kind, i, _DTYPES.index(t.dtype), t.dim(), *t.shape]
        header[3 + n * _FIELDS : 3 + n * _FIELDS + len(fields)] = torch.tensor(fields)
        parts.append(t.contiguous().view(-1).view(torch.uint8))
    payload = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8, device=device)
    header[0], header[1], header[2] = len(states), payload.numel(), int(more)
    return header.to(device), payload


def unpack(header: torch.Tensor, payload: torch.Tensor) -> dict[tuple[int, int], torch.Tensor]:
    fields = header.cpu().tolist()
    out, offset = {}, 0
    for n in range(fields[0]):
        kind, i, code, ndim, *dims = fields[3 + n * _FIELDS : 3 + (n + 1) * _FIELDS]
        dtype, shape = _DTYPES[code], dims[:ndim]
        size = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        out[kind, i] = payload[offset : offset + size].clone().view(dtype).view(shape)  # clone: aligned
        offset += size
    return out


def state_nbytes(cache) -> int:
    """Bytes of the conv and recurrent states a cache's recurrent layers hold."""
    return sum(t.nbytes for layer in cache.layers if is_recurrent(layer) for t in layer_states(layer).values())


def share_final_states(cache, comm, root: int) -> int:
    """After a chained prefill every rank takes the root's (the last partition's) recurrent states, all
    layers in one broadcast. Every rank ran every layer on as many sequences, so each one's own states
    have the root's shapes and dtypes: their layout sizes the message, and no header travels.
    Returns the bytes broadcast."""
    sent = _share_family_states(cache, comm, root)
    states = [
        (layer, key, t)
        for i, layer in enumerate(cache.layers)
        if is_recurrent(layer)
        for key, t in sorted(layer_states(layer).items())
    ]
    if not states:
        return sent
    mine = torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, _, t in states])
    shapes = [(mine.numel() if r == root else 0,) for r in range(comm.world)]
    got = comm.broadcast_blocks(mine if comm.rank == root else mine[:0], shapes)[root].wait()
    if comm.rank != root:
        offset = 0
        for layer, key, t in states:
            size = t.numel() * t.element_size()
            load_states(layer, {key: got[offset : offset + size].clone().view(t.dtype).view(t.shape)})
            offset += size
    return sent + mine.numel()


def _share_family_states(cache, comm, root: int) -> int:
    """`share_final_states` for a family's own chained layers (`ChainedLayer`'s states, patches/:
    DeepSeek-V4's compressors), whose states may differ in shape between ranks: a header per layer, then one payload."""
    layers = [layer for layer in cache.layers if isinstance(layer, ChainedLayer)]
    if not layers:
        return 0
    device = getattr(layers[0], "device", None) or torch.device("cpu")
    parts = [(layer, len(states)) for layer in layers for states in [layer.chained_states()]]
    packed = [pack({k: t.to(device) for k, t in s.items()}, device) for layer in layers for s in layer.chained_states()]
    headers = torch.cat([h for h, _ in packed])
    only = [(0,)] * comm.world  # the root's block alone
    only[root] = headers.shape
    got = comm.broadcast_blocks(headers if comm.rank == root else headers[:0], only, op="state_share")
    headers = got[root].wait() if comm.rank != root else headers
    sizes = headers.view(len(packed), HEADER)[:, 1].tolist()
    payload = torch.cat([p for _, p in packed]) if comm.rank == root else packed[0][1][:0]
    only[root] = (sum(sizes),)
    got = comm.broadcast_blocks(payload, only, op="state_share")
    payload = got[root].wait() if comm.rank != root else payload
    if comm.rank != root:
        offset, states = 0, []
        for header, size in zip(headers.view(len(packed), HEADER), sizes):
            states.append(unpack(header, payload[offset : offset + size]))
            offset += size
        for layer, count in parts:
            layer.load_chained_states(states[:count])
            states = states[count:]
    return headers.numel() * 8 + payload.numel()
