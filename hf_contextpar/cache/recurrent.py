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
Nemotron-H). So the chain runs behind the cache's state accessors (`ChainedStates`) for the forward whose context
holds it (`start_chain`: the chain is the forward's, handed on its context, never the cache's), and the models' own
mixers run unchanged: a chained rank's first touch of a layer receives the state (a header, then the payload),
and a layer's states go to the next rank as soon as they are final: at the write of the recurrent state
of a one-state layer (every mixer we run writes its conv state before it, and once), else once the
forward moves to another layer or ends (a conv-only layer sends its conv state alone). So the next
rank's wait ends before this rank's output projection, norms and MLP of that layer, not after them.

A hybrid layer (K/V and states in one cache layer) whose own states are written on both sides of its attention
(Inkling's short convolutions on K and V before it, on the attention output and the MLP after it) is "attended":
at its K/V update the states it wrote so far go (before any attention message, which may wait for every rank), and
each state it writes after its attention goes at that write; the message at its leaving closes it (what is left,
often nothing). The next rank reads each state where it first needs it (`needs`), so its wait for a state written
after the attention ends at this rank's write of it, not at the end of this rank's layer.

A one-state layer's conv state goes ahead of its recurrent state, at its write: the next rank's
convolution needs nothing else, so its wait at the layer's start ends after this rank's input
projection alone. The recurrent state follows in a second message, which the next rank receives where
it first reads it, or, inside a mixer that hands it to a kernel that takes it late (`takes_state_late`,
patches/gated_delta.py), where that kernel's scan needs it: after the input projection, convolution and
the scan's state-free work. The chain's lag between ranks is then the scan over states alone.

This file is the chain's one room: what it refuses at apply (`check`) and when a forward starts it
(`start_chain`), the chain (`StateChain`), the cache's side (`ChainedStates`) and the hooks the families' kernels call
(`received_state`, `takes_state_late`, `deferred_state`, `running_chain`).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch

from ..errors import PatchStateError, UnsupportedInputError, UnsupportedModelError
from .states import HEADER, is_recurrent, layer_states, load_states, pack, unpack

_abandoned: list = []  # the posted state sends of chains whose forward raised, until they complete
_running: ContextVar = ContextVar("hf_contextpar_chain", default=None)  # the chain of the running forward
_late: ContextVar = ContextVar("hf_contextpar_state_late", default=False)  # a mixer whose kernel takes its state late


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
    chain.arrived(chain.current)
    return chain.received.get((chain.current, state_idx))


@contextmanager
def takes_state_late():
    """Inside: a mixer that hands the recurrent state it reads from the cache to a kernel calling `deferred_state()`.
    A chained rank's read of a state still on its way returns None there, and that kernel takes it once it needs it
    (a read elsewhere waits for it)."""
    token = _late.set(True)
    try:
        yield
    finally:
        _late.reset(token)


def deferred_state():
    """For a kernel inside `takes_state_late`: None when the state it was given is the one to start from, else
    take() -> the recurrent state rank - 1 passed (waiting for it), which the cache handed out as None."""
    chain = _running.get()
    return chain.take if chain is not None and chain.deferred else None


class StateChain:
    """One forward's chain on one rank: receive from rank - 1 (unless first), send to rank + 1 (unless last).

    `comm`: the runtime's `Comm` (or a simulated one): `recv_prev` / `send_next` on the ring, whose
    messages are matched in posting order per pair of ranks, so both sides post in layer order (counted
    as "state_recv" / "state_send": a rank's waits there are the chain's idle time).
    """

    def __init__(self, comm, cache, receive: bool, send: bool):
        self.comm, self.cache, self.receive, self.send = comm, cache, receive, send
        self.visited: set[int] = set()  # recurrent layers this forward has touched
        self.sent: set[int] = set()  # layers whose outgoing state is posted
        self.final: set[int] = set()  # layers whose states were final before the forward left them (sent early)
        self.ahead: set[int] = set()  # one-state layers whose conv state went ahead of the rest (every rank's books)
        self.attended: set[int] = set()  # hybrid layers whose states were written before their attention (and after)
        self.written: dict[int, set] = {}  # per layer, the (kind, state index) this forward wrote
        self.shipped: dict[int, set] = {}  # per layer, the (kind, state index) posted to the next rank
        self.loaded: dict[int, set] = {}  # per layer, the (kind, state index) received from the previous rank
        self.current: int | None = None  # the recurrent layer the forward is in
        self.pending: int | None = None  # the layer whose later messages (an attended layer's too) are to come
        self.deferred = False  # the pending layer's recurrent state was read as None, for its kernel to `take`
        self.received: dict[tuple[int, int], torch.Tensor] = {}  # (layer, state index) -> recurrent state received
        self.token = None  # the ContextVar token of `_running` while this chain runs (`start_chain`)
        self._sends = []

    def enter(self, layer_idx: int) -> None:
        """The forward touches recurrent layer `layer_idx`: the previous layer is done (send it); load this one's."""
        if layer_idx == self.current:
            return
        if layer_idx in self.visited:
            raise UnsupportedModelError(
                f"recurrent layer {layer_idx} was used again after another layer in one forward; the state chain "
                "passes each layer's state once per forward."
            )
        self._leave()
        self.current = layer_idx
        self.visited.add(layer_idx)
        if self.receive:
            self._load(layer_idx)

    def _load(self, layer_idx: int) -> None:
        """The next message rank - 1 sent, into `layer_idx`; if it says more follows, that is now pending."""
        header = self.comm.recv_prev((HEADER,), torch.long, _device(self.cache, layer_idx), op="state_recv").wait()
        states = self._payload(header)
        load_states(self.cache.layers[layer_idx], states)
        self.loaded.setdefault(layer_idx, set()).update(states)
        self.received.update({(layer_idx, i): t for (kind, i), t in states.items() if kind == 1})
        self.pending = layer_idx if int(header[2]) else None

    def _payload(self, header) -> dict:
        nbytes = int(header[1])
        payload = self.comm.recv_prev((nbytes,), torch.uint8, header.device, op="state_recv").wait() if nbytes else None
        return unpack(header, payload) if nbytes else {}

    def receive_states(self, device) -> dict:
        """The next states rank - 1 sent (a header, then the payload): messages match in posting order, so a
        recurrent layer's second message still due is taken first."""
        if self.deferred:
            self._refuse_untaken()
        self.complete()
        return self._payload(self.comm.recv_prev((HEADER,), torch.long, device, op="state_recv").wait())

    def send_states(self, states: dict, device, more: bool = False) -> None:
        """States to rank + 1 (a family's chained layer's too, patches/deepseek_v4.py), waited for at `finish`."""
        header, payload = pack(states, device, more)
        self._sends.append(self.comm.send_next(header, op="state_send"))
        if payload.numel():
            self._sends.append(self.comm.send_next(payload, op="state_send"))

    def complete(self) -> None:
        """Receive the pending layer's other messages (its recurrent state, an attended layer's later states) now."""
        while self.pending is not None:
            self._load(self.pending)

    def needs(self, layer_idx: int, key: tuple) -> None:
        """A read of state `key` (kind, index) of `layer_idx`: if rank - 1 has not sent it yet (an attended layer's
        state written after its attention), receive its messages until it is there or the layer's last is in."""
        while self.pending == layer_idx and key not in self.loaded.get(layer_idx, ()):
            self._load(layer_idx)

    def attend(self, layer_idx: int) -> None:
        """The forward reaches the K/V update of `layer_idx`. Another recurrent layer before it is done (sent, as
        `leave_layer`); a hybrid layer that wrote its own states before its attention and has not finished them (no
        final recurrent state) becomes attended: what it wrote goes now, before any attention message, and the rest
        as it is written (`wrote`), with more to follow until the forward leaves it."""
        if self.current != layer_idx or layer_idx in self.final:
            self.leave_layer()
            return
        self.attended.add(layer_idx)
        written = self.written.get(layer_idx, set())
        self._post(layer_idx, {k: t for k, t in layer_states(self.cache.layers[layer_idx]).items() if k in written})

    def arrived(self, layer_idx: int) -> None:
        """Something other than a late kernel reads `layer_idx`'s state: receive it now, unless handed out late."""
        if self.pending == layer_idx and not self.deferred:
            self.complete()

    def defer(self, layer_idx: int) -> bool:
        """A read of `layer_idx`'s recurrent state: True if it is still on its way and the reader's kernel takes it
        late (None is handed out); else the state is there when this returns."""
        if self.pending == layer_idx and (self.deferred or _late.get()):
            self.deferred = True
            return True
        self.arrived(layer_idx)
        return False

    def take(self) -> torch.Tensor | None:
        """The deferred recurrent state (a kernel of `takes_state_late`'s mixer, once its scan needs it)."""
        layer_idx, self.deferred = self.pending, False
        self.complete()
        return self.received.get((layer_idx, 0))

    def wrote(self, layer_idx: int, recurrent: bool, state_idx: int = 0) -> None:
        """The mixer wrote a state of `layer_idx`. An attended layer's goes now. A one-state layer's conv state (its
        first write) goes ahead, and its recurrent state (its last write) is final: send now, ahead of the layer's
        scan, output projection and MLP. Every rank keeps the same books (a write out of that order raises alike on
        every rank, before the next rank could use a stale state)."""
        layer, key = self.cache.layers[layer_idx], (int(recurrent), state_idx)
        self.written.setdefault(layer_idx, set()).add(key)
        if layer_idx in self.attended:
            self._post(layer_idx, {key: layer_states(layer)[key]})
            return
        if layer_idx in self.final or (not recurrent and layer_idx in self.ahead):
            raise UnsupportedModelError(
                f"recurrent layer {layer_idx} wrote a state after its recurrent state, or its conv state twice, in "
                "one forward; the state chain sends a one-state layer's conv state and then its recurrent state at "
                "their writes."
            )
        if layer.number_of_states != 1:
            return
        if recurrent:
            if self.deferred:
                self._refuse_untaken()
            self.complete()  # a mixer that never read the state it replaces: the message order stays
            self.final.add(layer_idx)
            self._flush()
        else:
            self.ahead.add(layer_idx)
            self._post(layer_idx, {k: t for k, t in layer_states(layer).items() if k[0] == 0})

    def _post(self, layer_idx: int, states: dict, more: bool = True) -> None:
        """Some of `layer_idx`'s states to the next rank (more follow unless `more` is False), in the books."""
        self.shipped.setdefault(layer_idx, set()).update(states)
        if self.send:
            self.send_states(states, _device(self.cache, layer_idx), more=more)

    def leave_layer(self) -> None:
        """The forward moved on to an attention layer: the recurrent layer before it is done, send its state
        now (before any attention message, which may wait for every rank: ring pass-KV does)."""
        self._leave()
        self.current = None

    def end(self) -> None:
        """The forward completed: the last layer's states to the next rank (`finish`), and the kernels' route to the
        chain is closed."""
        self._release()
        self.finish()

    def abandon(self) -> None:
        """The forward raised: forget the chain without sending more (a no-op once it ended). The states it posted
        already stay referenced until they are sent (`_abandoned`): a dropped gloo send is cancelled, and the next
        rank, which raises alike later in the same forward, may still be waiting for it."""
        if self.token is not None:
            self._release()
            _abandoned[:] = [p for p in _abandoned if not p.done()] + self._sends

    def _release(self) -> None:
        if self.token is not None:
            _running.reset(self.token)
            self.token = None

    def finish(self) -> None:
        """The forward is over: send the last layer's state, and wait for every send."""
        self.leave_layer()
        for pending in self._sends:
            pending.wait()
        self._sends.clear()

    def _leave(self) -> None:
        """The forward leaves the current layer: its states go, and its second message is taken."""
        if self.deferred:
            self._refuse_untaken()
        self._flush()
        self.complete()

    def _refuse_untaken(self):
        raise PatchStateError(
            f"recurrent layer {self.pending}'s mixer handed its recurrent state to a kernel that did not take it "
            "(hf_contextpar.cache.recurrent.deferred_state): it ran from no state. Its forward calls a kernel other "
            "than its modeling module's: apply context parallelism after patching the model, or report this model."
        )

    def _flush(self) -> None:
        layer_idx = self.current
        if layer_idx is None or not self.send or layer_idx in self.sent:
            return
        shipped = self.shipped.get(layer_idx, ())
        states = {k: t for k, t in layer_states(self.cache.layers[layer_idx]).items() if k not in shipped}
        self._post(layer_idx, states, more=False)
        self.sent.add(layer_idx)


def _device(cache, layer_idx: int):
    layer = cache.layers[layer_idx]
    return layer.device if layer.device is not None else torch.device("cpu")


def check(facts) -> bool:
    """At apply (capabilities.py): does the model chain recurrent states, after refusing what would split or move
    them, which are whole on every rank: batched pass-Q decode and DCP."""
    if not facts.recurrent:
        return False
    if facts.settings.decode == "ring_pass_q" or facts.dcp is not None:
        dcp = facts.dcp
        what = "decode='ring_pass_q' (it moves sequences between ranks)" if dcp is None else "DCP (--tp over KV heads)"
        raise UnsupportedModelError(
            f"{what} is not supported on a model with recurrent layers: their states are whole on every rank "
            "and pass down the ranks in prefill. Use decode='auto' or 'replicated', and TP up to the KV heads."
        )
    return True


def start_chain(context, cache, comm, receive: bool, send: bool) -> StateChain:
    """Start the chain of the forward `context` (plan/context.ForwardContext) on `cache`: it lives on the context and
    goes with it (`StateChain.end` when the forward completes, `StateChain.abandon` when it raised). A receiving
    rank's recurrent layers continue from the incoming state."""
    if any(getattr(layer, "record_past", False) for layer in cache.layers):
        raise UnsupportedInputError(  # assisted decoding's: the conv states would then grow per rank
            "assisted and prompt-lookup decoding (a cache recording its past for crop()) are not supported "
            "on models with recurrent layers under context parallelism: decode without them."
        )
    chain = context.chain = StateChain(comm, cache, receive, send)
    chain.token = _running.set(chain)  # for the kernels that see no cache (received_state, deferred_state)
    return chain


class ChainedStates:
    """Mixin for a transformers `Cache` (listed before it): its recurrent layers' states pass along the chain.

    While the running forward's context holds a chain (`start_chain`), every state access of a recurrent layer goes
    through it; otherwise the cache is the plain transformers cache (decode: every rank holds the same state and
    updates it from the same tokens). The chain is the forward's, never the cache's: nothing of it stays after
    the forward.
    """

    context = None  # the running forward's plan/context.ForwardContext (ShardedCache.begin); None between forwards

    @property
    def chain(self) -> StateChain | None:
        """The running forward's chain, or None."""
        return self.context.chain if self.context is not None else None

    def _enter(self, layer_idx):
        if self.chain is not None and layer_idx is not None and is_recurrent(self.layers[layer_idx]):
            self.chain.enter(layer_idx)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if self.chain is not None:  # K/V of an attention layer: the recurrent layer before it is done (or attended)
            self.chain.attend(layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        self._enter(layer_idx)
        self._needs(layer_idx, (0, state_idx))
        return super().get_conv_state(layer_idx, state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        self._enter(layer_idx)
        if self.chain is not None and self.chain.defer(layer_idx):
            return None  # its kernel takes it late (takes_state_late)
        return super().get_recurrent_state(layer_idx, state_idx)

    def update_conv_state(self, conv_states, layer_idx: int, state_idx: int = 0, **kwargs):
        self._enter(layer_idx)
        self._needs(layer_idx, (0, state_idx))
        out = super().update_conv_state(conv_states, layer_idx, state_idx, **kwargs)
        self._wrote(layer_idx, False, state_idx)
        return out

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs):
        self._enter(layer_idx)
        out = super().update_recurrent_state(recurrent_states, layer_idx, state_idx, **kwargs)
        self._wrote(layer_idx, True, state_idx)
        return out

    def _wrote(self, layer_idx, recurrent: bool, state_idx: int):
        if self.chain is not None and is_recurrent(self.layers[layer_idx]):
            self.chain.wrote(layer_idx, recurrent, state_idx)

    def _needs(self, layer_idx, key):
        if self.chain is not None and is_recurrent(self.layers[layer_idx]):
            self.chain.needs(layer_idx, key)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        self._enter(layer_idx)
        if self.chain is not None and layer_idx is not None:
            self.chain.arrived(layer_idx)  # it reports on the recurrent state too
        return super().has_previous_state(layer_idx, state_idx)
