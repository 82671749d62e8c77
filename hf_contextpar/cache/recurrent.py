"""Recurrent layers (linear attention, state-space, short convolutions) under context parallelism: the state chain.

A recurrent layer's output over a span depends only on its inputs there and on the state everything
before the span left: the convolution's last `kernel` inputs and the recurrent state. So the prompt
is cut into contiguous partitions in sequence order (KV-Runahead's), and rank r runs each recurrent
layer on its own tokens from the state rank r - 1 left there, then hands its own final state to rank
r + 1. The ranks pipeline over the layers: rank r runs layer l while rank r - 1 runs layer l + 1.

transformers' mixers (GatedDeltaNet, Mamba / Mamba2, short convolutions, lightning attention, ...)
read and write that state only through the cache (`get_conv_state`, `get_recurrent_state`,
`update_conv_state`, `update_recurrent_state`, `has_previous_state`, per layer and state index), and
continue a multi-token forward from a cached state exactly (chunked prefill equals one forward to
5e-14 in fp64, the models' fp32 internals run in fp64: Qwen3-Next, Qwen3.5, Granite 4.0-H,
Nemotron-H). So the chain lives in the cache, `ChainedStates`, and the models' own mixers run
unchanged: a chained rank's first touch of a layer receives the state (a header, then the payload),
and a layer's states go to the next rank as soon as they are final: at the write of the recurrent state
of a one-state layer (every mixer we run writes its conv state before it, and once), else once the
forward moves to another layer or ends (a conv-only layer sends its conv state alone). So the next
rank's wait ends before this rank's output projection, norms and MLP of that layer, not after them.
"""

from __future__ import annotations

from contextvars import ContextVar

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from ..errors import UnsupportedModelError
from .layers import ChainedLayer

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_MAX_DIMS = 6
_FIELDS = 4 + _MAX_DIMS  # per state: kind (0 conv, 1 recurrent), state index, dtype, ndim, dims
_MAX_STATES = 8
HEADER = 2 + _FIELDS * _MAX_STATES  # states, payload bytes, then the states' fields


_abandoned: list = []  # the posted state sends of chains whose forward raised, until they complete
_running: ContextVar = ContextVar("hf_contextpar_chain", default=None)  # the chain of the running forward


def running_chain():
    """The state chain of the running forward on this rank, or None (no chained forward runs)."""
    return _running.get()


def received_state(state_idx: int = 0):
    """The recurrent state this rank received for the recurrent layer the running chained forward is in (the
    state before its partition), or None: no chain runs, or this rank is the first. For a mixer whose
    multi-token scan starts from zero whatever the cache holds (Mamba1's), to add the passed state's share."""
    chain = _running.get()
    if chain is None or chain.current is None:
        return None
    return chain.received.get((chain.current, state_idx))


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


def pack(states: dict[tuple[int, int], torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload): a fixed-size int64 header describing the states, and their bytes in one buffer."""
    if len(states) > _MAX_STATES or any(t.dim() > _MAX_DIMS or t.dtype not in _DTYPES for t in states.values()):
        raise UnsupportedModelError(
            f"a recurrent layer's cached states {[(tuple(t.shape), t.dtype) for t in states.values()]} do not fit "
            f"the state chain's header (at most {_MAX_STATES} states of {_MAX_DIMS} dimensions in {_DTYPES})."
        )
    header = torch.zeros(HEADER, dtype=torch.long)
    parts = []
    for n, ((kind, i), t) in enumerate(sorted(states.items())):
        fields = [kind, i, _DTYPES.index(t.dtype), t.dim(), *t.shape]
        header[2 + n * _FIELDS : 2 + n * _FIELDS + len(fields)] = torch.tensor(fields)
        parts.append(t.contiguous().view(-1).view(torch.uint8))
    payload = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8, device=device)
    header[0], header[1] = len(states), payload.numel()
    return header.to(device), payload


def unpack(header: torch.Tensor, payload: torch.Tensor) -> dict[tuple[int, int], torch.Tensor]:
    fields = header.cpu().tolist()
    out, offset = {}, 0
    for n in range(fields[0]):
        kind, i, code, ndim, *dims = fields[2 + n * _FIELDS : 2 + (n + 1) * _FIELDS]
        dtype, shape = _DTYPES[code], dims[:ndim]
        size = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        out[kind, i] = payload[offset : offset + size].clone().view(dtype).view(shape)  # clone: aligned
        offset += size
    return out


class StateChain:
    """One forward's chain on one rank: receive from rank - 1 (unless first), send to rank + 1 (unless last).

    `comm`: the runtime's `Comm` (or a simulated one): `recv_prev` / `send_next` on the ring, whose
    messages are matched in posting order per pair of ranks, so both sides post in layer order (counted
    as "state_recv" / "state_send": a rank's waits there are the chain's idle time).
    """

    def __init__(self, comm, receive: bool, send: bool):
        self.comm, self.receive, self.send = comm, receive, send
        self.visited: set[int] = set()  # recurrent layers this forward has touched
        self.sent: set[int] = set()  # layers whose outgoing state is posted
        self.final: set[int] = set()  # layers whose states were final before the forward left them (sent early)
        self.current: int | None = None  # the recurrent layer the forward is in
        self.received: dict[tuple[int, int], torch.Tensor] = {}  # (layer, state index) -> recurrent state received
        self.token = None  # the ContextVar token of `_running` while this chain runs (ChainedStates.begin_chain)
        self._sends = []

    def enter(self, cache, layer_idx: int) -> None:
        """The forward touches recurrent layer `layer_idx`: the previous layer is done (send it); load this one's."""
        if layer_idx == self.current:
            return
        if layer_idx in self.visited:
            raise UnsupportedModelError(
                f"recurrent layer {layer_idx} was used again after another layer in one forward; the state chain "
                "passes each layer's state once per forward."
            )
        self._flush(cache)
        self.current = layer_idx
        self.visited.add(layer_idx)
        if self.receive:
            states = self.receive_states(_device(cache, layer_idx))
            load_states(cache.layers[layer_idx], states)
            self.received.update({(layer_idx, i): t for (kind, i), t in states.items() if kind == 1})

    def receive_states(self, device) -> dict:
        """The next states rank - 1 sent (a header, then the payload): messages match in posting order."""
        header = self.comm.recv_prev((HEADER,), torch.long, device, op="state_recv").wait()
        nbytes = int(header[1])
        payload = self.comm.recv_prev((nbytes,), torch.uint8, header.device, op="state_recv").wait() if nbytes else None
        return unpack(header, payload) if nbytes else {}

    def send_states(self, states: dict, device) -> None:
        """States to rank + 1 (a family's chained layer's too, patches/deepseek_v4.py), waited for at `finish`."""
        header, payload = pack(states, device)
        self._sends.append(self.comm.send_next(header, op="state_send"))
        if payload.numel():
            self._sends.append(self.comm.send_next(payload, op="state_send"))

    def wrote(self, cache, layer_idx: int, recurrent: bool) -> None:
        """The mixer wrote a state of `layer_idx`. The recurrent state of a one-state layer is its last write (its
        conv state comes before it): send now, ahead of the layer's output projection and MLP. Every rank keeps the
        same books (a write after that raises alike on every rank, before the next rank could use a stale state)."""
        if layer_idx in self.final:
            raise UnsupportedModelError(
                f"recurrent layer {layer_idx} wrote a state after its recurrent state in one forward; the state chain "
                "sends a one-state layer's states at that write."
            )
        if recurrent and cache.layers[layer_idx].number_of_states == 1:
            self.final.add(layer_idx)
            self._flush(cache)

    def settle(self, cache) -> None:
        """The forward moved on to an attention layer: the recurrent layer before it is done, send its state
        now (before any attention message, which may wait for every rank: ring pass-KV does)."""
        self._flush(cache)
        self.current = None

    def finish(self, cache) -> None:
        """The forward is over: send the last layer's state, and wait for every send."""
        self.settle(cache)
        for pending in self._sends:
            pending.wait()
        self._sends.clear()

    def _flush(self, cache) -> None:
        layer_idx = self.current
        if layer_idx is None or not self.send or layer_idx in self.sent:
            return
        self.send_states(layer_states(cache.layers[layer_idx]), _device(cache, layer_idx))
        self.sent.add(layer_idx)


def _device(cache, layer_idx: int):
    layer = cache.layers[layer_idx]
    return layer.device if layer.device is not None else torch.device("cpu")


class ChainedStates:
    """Mixin for a transformers `Cache` (listed before it): its recurrent layers' states pass along the chain.

    Between `begin_chain` and `end_chain` every state access of a recurrent layer goes through the
    chain; outside them the cache is the plain transformers cache (decode: every rank holds the same
    state and updates it from the same tokens).
    """

    chain: StateChain | None = None

    def begin_chain(self, comm, receive: bool, send: bool) -> None:
        """Start a chained forward. A receiving rank's recurrent layers continue from the incoming state."""
        self.chain = StateChain(comm, receive, send)
        # the ContextVar token stays on the chain, which the cache drops at the forward's end: a cache between
        # forwards holds tensors and plain data alone, so it deep-copies, pickles and torch.saves (a Token does not)
        self.chain.token = _running.set(self.chain)

    def end_chain(self) -> None:
        chain, self.chain = self.chain, None
        if chain is not None:
            _running.reset(chain.token)
            chain.finish(self)

    def drop_chain(self) -> None:
        """A forward that raised: forget its chain without sending more. The states it posted already stay
        referenced until they are sent (`_abandoned`): a dropped gloo send is cancelled, and the next rank,
        which raises alike later in the same forward, may still be waiting for it."""
        chain, self.chain = self.chain, None
        if chain is not None:
            _running.reset(chain.token)
            _abandoned[:] = [p for p in _abandoned if not p.done()] + chain._sends

    def _enter(self, layer_idx):
        if self.chain is not None and layer_idx is not None and is_recurrent(self.layers[layer_idx]):
            self.chain.enter(self, layer_idx)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if self.chain is not None:  # K/V of an attention layer: the recurrent layer before it is done
            self.chain.settle(self)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        self._enter(layer_idx)
        return super().get_conv_state(layer_idx, state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        self._enter(layer_idx)
        return super().get_recurrent_state(layer_idx, state_idx)

    def update_conv_state(self, conv_states, layer_idx: int, state_idx: int = 0, **kwargs):
        self._enter(layer_idx)
        out = super().update_conv_state(conv_states, layer_idx, state_idx, **kwargs)
        self._wrote(layer_idx, recurrent=False)
        return out

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs):
        self._enter(layer_idx)
        out = super().update_recurrent_state(recurrent_states, layer_idx, state_idx, **kwargs)
        self._wrote(layer_idx, recurrent=True)
        return out

    def _wrote(self, layer_idx, recurrent: bool):
        if self.chain is not None and is_recurrent(self.layers[layer_idx]):
            self.chain.wrote(self, layer_idx, recurrent)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        self._enter(layer_idx)
        return super().has_previous_state(layer_idx, state_idx)


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
