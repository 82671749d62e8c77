"""The recurrent state chain (hf_contextpar/cache/recurrent.py) on simulated ranks, with transformers' own mixers.

Each family's tiny model is made of its recurrent layers only (no attention, whose context parallelism is
the rest of the suite), in fp64 with the model's deliberate fp32 internals run in fp64 (the census's
`Fp64Internals`), so exact means ~1e-13. Rank r runs the whole model on its contiguous partition of the
prompt from the state rank r - 1 passed; every rank then takes the last rank's states and decodes: the
partitions' logits must be the whole prompt's on one process, and every rank's decode step the one
process's. N = 2, 3, 4 on an uneven length, padded rows whose padding reaches into the second partition.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from types import SimpleNamespace

import pytest
import torch
from hf_contextpar.eval.oracle import Fp64Internals
from hybrids import SIZES
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from dev.census.configs import _known, tiny_config
from hf_contextpar.cache.recurrent import ChainedStates, start_chain
from hf_contextpar.cache.sharded import cache_argument
from hf_contextpar.cache.states import layer_states, pack, share_final_states, unpack
from hf_contextpar.errors import UnsupportedModelError
from hf_contextpar.tools.selftest.simulated import SimulatedWorld

# family -> its recurrent layer kind (all layers made of it), None where the family has only that kind
FAMILIES = {
    "qwen3_next": "linear_attention",  # GatedDeltaNet
    "granitemoehybrid": "linear_attention",  # Mamba2
    "nemotron_h": "linear_attention",  # Mamba2
    "mamba2": None,
    "lfm2_moe": "conv",  # short convolutions
    "zamba2": "linear_attention",  # Mamba2
    "qwen3_5_text": "linear_attention",  # GatedDeltaNet
    "kimi_linear": "linear_attention",  # KDA
}
# Not here: Mamba1's scan
# (mamba, falcon_mamba, jamba) starts every multi-token forward from a zero state (transformers: "Initial hidden
# state is not supported by the kernel path"), so it cannot continue from a passed one without a patch
# (patches/mamba1.py, tested below): chained, it is 1.3 (N = 2) to 3.0 (N = 4) off without it. MiniMax keeps its lightning attention's state in its own
# MiniMaxCache (set_linear_cache / get_linear_cache), outside transformers' state API. bailing_hybrid's chain
# is verified by the census (N = 2, 3, 4, fp64 with its fp32 internals in fp64).
# smaller states than the census's tiny configs, chunked scans cut inside every partition (tests/workers/hybrids.py)
EXACT = 1e-11
LENGTH = 61


class ChainCache(ChainedStates, DynamicCache):
    """The global length comes from the driver, as ShardedCache reports it (a cache of recurrent layers alone
    has none: transformers asks its attention layers)."""

    past = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.past

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.past + query_length, 0  # the mask transformers builds for attention layers, here none


def begin_chain(cache, comm, receive: bool, send: bool):
    """The chain of a forward on `cache`, as the runtime starts it: on the forward's context, which the cache is handed
    (here the context as far as the chain reads it: a forward without attention has no plan to run)."""
    cache.context = SimpleNamespace(chain=None)
    return start_chain(cache.context, cache, comm, receive=receive, send=send)


def recurrent_model(family: str):
    config = tiny_config(family)
    kind = FAMILIES[family]
    kw = {**_known(config), **SIZES.get(family, {})}
    if kind is not None:
        kw["layer_types"] = [kind] * config.num_hidden_layers
    config = AutoConfig.for_model(family, **kw)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(config, dtype=torch.float64, experts_implementation="eager").eval()


def _forward(model, ids, mask, cache, cols):
    """cols: the tokens' global positions (the runtime passes them; a cache of recurrent layers alone has no
    length to derive them from)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reference kernels' fallback notices
        kw = {cache_argument(model): cache}  # Mamba / Mamba2 take `cache` alone (no past_key_values alias)
        return model(input_ids=ids, attention_mask=mask, position_ids=cols[None], use_cache=True, **kw).logits


def one_process(model, ids, mask, nxt):
    with torch.no_grad(), Fp64Internals():
        cache = ChainCache(config=model.config)
        prompt = _forward(model, ids, mask, cache, torch.arange(ids.shape[1]))
        mask2 = torch.cat([mask, torch.ones_like(nxt)], 1) if mask is not None else None
        cache.past = ids.shape[1]
        return prompt, _forward(model, nxt, mask2, cache, torch.tensor([ids.shape[1]]))


def chained(model, ids, mask, nxt, world):
    parts = torch.arange(ids.shape[1]).tensor_split(world)

    def rank(comm):
        r = comm.rank
        with torch.no_grad(), Fp64Internals():
            cache = ChainCache(config=model.config)
            cache.past = int(parts[r][0])
            begin_chain(cache, comm, receive=r > 0, send=r < world - 1)
            m = mask[:, parts[r]] if mask is not None else None  # the rank's own columns of the padding mask
            prompt = _forward(model, ids[:, parts[r]], m, cache, parts[r])
            cache.context.chain.end()
            cache.context = None  # the forward is over (ShardedCache.end drops its context)
            share_final_states(cache, comm, root=world - 1)
            mask2 = torch.cat([mask, torch.ones_like(nxt)], 1) if mask is not None else None
            cache.past = ids.shape[1]
            return prompt, _forward(model, nxt, mask2, cache, torch.tensor([ids.shape[1]]))

    return SimulatedWorld(world, timeout=900).run([rank] * world)  # a rank waits for the whole chain before it


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(request):
    """With the patch its family gets (patches/gated_delta.py: Gated DeltaNet's kernel takes the state late)."""
    from hf_contextpar.patches import gated_delta

    model = recurrent_model(request.param)
    undo = gated_delta.apply(model)
    yield request.param, model
    undo()


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("padded", [False, True])
def test_chain_matches_one_process(family_model, world, padded):
    family, model = family_model
    g = torch.Generator().manual_seed(world)
    ids = torch.randint(3, 256, (2, LENGTH), generator=g)
    nxt = torch.randint(3, 256, (2, 1), generator=g)
    mask = None
    if padded:  # row 1's padding reaches into the second partition at every N
        mask = torch.ones(2, LENGTH, dtype=torch.long)
        mask[1, :33] = 0
    want_prompt, want_next = one_process(model, ids, mask, nxt)
    results = chained(model, ids, mask, nxt, world)
    got = torch.cat([p for p, _ in results], 1)
    rows = mask.bool() if mask is not None else torch.ones(2, LENGTH, dtype=torch.bool)
    diff = (got - want_prompt).abs().amax(-1)[rows].max().item()
    assert diff < EXACT, f"{family} N={world}: the chained prompt is {diff:.2e} from one process"
    for r, (_, step) in enumerate(results):
        d = (step - want_next).abs().max().item()
        assert d < EXACT, f"{family} N={world}: rank {r}'s decode step is {d:.2e} from one process"


def test_chain_fails_without_the_passed_state():
    """The check can fail: ranks that start from zero state (no chain) are far from one process."""
    model = recurrent_model("qwen3_next")
    ids = torch.randint(3, 256, (1, LENGTH), generator=torch.Generator().manual_seed(0))
    want, _ = one_process(model, ids, None, ids[:, :1])
    with torch.no_grad(), Fp64Internals():
        second = _forward(model, ids[:, 30:], None, ChainCache(config=model.config), torch.arange(30, LENGTH))
    assert (second - want[:, 30:]).abs().max().item() > 1e-3


def test_pack_round_trip():
    states = {
        (0, 0): torch.randn(2, 5, 4, dtype=torch.bfloat16),
        (1, 0): torch.randn(2, 3, 8, 8, dtype=torch.float32),
        (1, 1): torch.randn(1, dtype=torch.float64),
    }
    header, payload = pack(states, torch.device("cpu"))
    back = unpack(header, payload)
    assert back.keys() == states.keys()
    assert all(torch.equal(back[k], states[k]) and back[k].dtype == states[k].dtype for k in states)
    with pytest.raises(UnsupportedModelError, match="do not fit"):
        pack({(0, i): torch.zeros(1) for i in range(9)}, torch.device("cpu"))


def test_a_layer_used_twice_is_refused():
    """The chain passes a layer's state once per forward: a mixer that comes back to a layer is refused."""
    model = recurrent_model("mamba2")
    world = SimulatedWorld(1)
    cache = ChainCache(config=model.config)
    begin_chain(cache, world.comms[0], receive=False, send=False)
    cache.has_previous_state(0, 0)
    cache.has_previous_state(1, 0)
    with pytest.raises(UnsupportedModelError, match="used again"):
        cache.has_previous_state(0, 0)
    assert layer_states(cache.layers[0]) == {}


class _Sends:
    """A last rank's comm stand-in: counts the state messages posted to the next rank."""

    rank, world = 0, 2

    def __init__(self):
        self.posted = []

    def send_next(self, t, op):
        self.posted.append((op, t))
        return SimpleNamespace(wait=lambda: None, done=lambda: True)

    def headers(self):
        """(messages of each state send: 2 with a payload, more follows) per header posted."""
        heads = [i for i, (_, t) in enumerate(self.posted) if t.dtype == torch.long]
        ends = heads[1:] + [len(self.posted)]
        return [(e - h, bool(self.posted[h][1][2])) for h, e in zip(heads, ends)]

    def states(self):
        ts = [t for _, t in self.posted]
        return [unpack(ts[i], ts[i + 1]) for i in range(0, len(ts), 2)]


def test_a_layers_states_go_at_their_writes():
    """A one-state layer's conv state goes to the next rank at its write (ahead of the scan), its recurrent state at
    its own write (its last), before the layer's output projection and MLP run; a conv state written twice or a
    state written after the recurrent one is refused on every rank alike."""
    model = recurrent_model("qwen3_next")
    comm = _Sends()
    cache = ChainCache(config=model.config)
    begin_chain(cache, comm, receive=False, send=True)
    cache.update_conv_state(torch.zeros(1, 4, 6), 0, conv_kernel_size=4)
    assert comm.headers() == [(2, True)]  # header and payload; more follows
    with pytest.raises(UnsupportedModelError, match="conv state twice"):
        cache.update_conv_state(torch.zeros(1, 4, 6), 0, conv_kernel_size=4)
    cache.update_recurrent_state(torch.zeros(1, 2, 3, 3), 0)
    assert [more for _, more in comm.headers()] == [True, False] and len(comm.posted) == 4
    assert comm.states()[1].keys() == {(1, 0)}  # the recurrent state alone: the conv state went ahead
    cache.get_conv_state(0)  # reading it again is fine, and sends nothing more
    assert len(comm.posted) == 4
    with pytest.raises(UnsupportedModelError, match="after its recurrent state"):
        cache.update_conv_state(torch.zeros(1, 4, 6), 0, conv_kernel_size=4)
    cache.context.chain.abandon()


class _Receives:
    """A second rank's comm stand-in: rank 0's messages, in order."""

    rank, world = 1, 2

    def __init__(self, *messages):
        self.queue = [t for header, payload in messages for t in (header, payload)]

    def recv_prev(self, shape, dtype, device, op):
        t = self.queue.pop(0)
        assert t.shape == shape and t.dtype == dtype
        return SimpleNamespace(wait=lambda: t)


def test_a_late_kernel_takes_the_passed_state_and_only_it():
    """Inside `takes_state_late` (patches/gated_delta.py's mixers) the read of a recurrent state still on its way
    returns None and the kernel takes it (`deferred_state`); outside, the read waits for it. A mixer whose kernel
    never takes it is refused before its state goes on (it ran from no state)."""
    from hf_contextpar.cache.recurrent import deferred_state, takes_state_late
    from hf_contextpar.errors import PatchStateError

    model = recurrent_model("qwen3_next")
    conv, state = torch.randn(1, 4, 3, dtype=torch.float64), torch.randn(1, 2, 3, 3, dtype=torch.float64)
    sent = lambda: _Receives(pack({(0, 0): conv}, "cpu", more=True), pack({(1, 0): state}, "cpu"))  # noqa: E731
    for late in (False, True):
        cache = ChainCache(config=model.config)
        begin_chain(cache, comm := sent(), receive=True, send=False)
        assert torch.equal(cache.get_conv_state(0), conv) and len(comm.queue) == 2  # the conv state alone so far
        with takes_state_late() if late else contextlib.nullcontext():
            got = cache.get_recurrent_state(0)
            if late:
                assert got is None and len(comm.queue) == 2
                got = deferred_state()()
            assert deferred_state() is None
        assert torch.equal(got, state) and comm.queue == []
        cache.context.chain.end()
    cache = ChainCache(config=model.config)
    begin_chain(cache, sent(), receive=True, send=False)
    with takes_state_late():
        assert cache.get_recurrent_state(0) is None
    with pytest.raises(PatchStateError, match="did not take it"):
        cache.update_recurrent_state(torch.zeros(1, 2, 3, 3), 0)
    cache.context.chain.abandon()


def test_a_kernel_put_in_after_the_patch_gets_the_state():
    """A user's own kernel in the modeling module after patches/gated_delta.py wrapped it (flash-linear-attention's,
    say) is handed the passed state as the mixer reads it: the chain stays exact (and the wrapped one takes it late)."""
    from hf_contextpar.patches import gated_delta
    from transformers.models.qwen3_next import modeling_qwen3_next as module

    from hf_contextpar.cache import recurrent

    model = recurrent_model("qwen3_next")
    ids = torch.randint(3, 256, (1, LENGTH), generator=torch.Generator().manual_seed(1))
    want, _ = one_process(model, ids, None, ids[:, :1])
    undo = gated_delta.apply(model)
    taken, take = [], recurrent.StateChain.take
    try:
        recurrent.StateChain.take = lambda chain: taken.append(chain.pending) or take(chain)
        wrapped = module.torch_chunk_gated_delta_rule
        users = [lambda *a, **k: wrapped.__wrapped__(*a, **k) for _ in range(2)]
        functools.wraps(wrapped)(users[1])  # it copies our wrapper's attributes: still not ours
        for kernel, late in [(wrapped, True), (users[0], False), (users[1], False)]:
            module.torch_chunk_gated_delta_rule, taken[:] = kernel, []
            got = torch.cat([p for p, _ in chained(model, ids, None, ids[:, :1], 3)], 1)
            assert (got - want).abs().max().item() < EXACT
            assert len(taken) == (2 * model.config.num_hidden_layers if late else 0)
        module.torch_chunk_gated_delta_rule = wrapped
    finally:
        recurrent.StateChain.take = take
        undo()


def test_the_patch_counts_models_and_leaves_a_users_kernel():
    """Two models of one class: undoing one keeps the other's patch. Undoing the last puts transformers' own kernel
    back, unless a user's own went in after."""
    from hf_contextpar.patches import gated_delta
    from transformers.models.qwen3_next import modeling_qwen3_next as module

    original = module.torch_chunk_gated_delta_rule
    a, b = recurrent_model("qwen3_next"), recurrent_model("qwen3_next")
    undo_a, undo_b = gated_delta.apply(a), gated_delta.apply(b)
    undo_a()
    assert module.torch_chunk_gated_delta_rule in gated_delta._LATE_KERNELS
    undo_b()
    assert module.torch_chunk_gated_delta_rule is original
    undo = gated_delta.apply(a)
    module.torch_chunk_gated_delta_rule = mine = lambda *args, **kw: original(*args, **kw)
    undo()
    assert module.torch_chunk_gated_delta_rule is mine
    module.torch_chunk_gated_delta_rule = original


def test_split_kernel_is_transformers_own():
    """patches/gated_delta.py's `prepare` + `scan` are each modeling module's chunked Gated DeltaNet kernel cut in
    two: bit for bit the same (fp32 and fp64, from zero and from a state, grouped value heads, a ragged chunk)."""
    import importlib

    from hf_contextpar.patches import gated_delta

    g = torch.Generator().manual_seed(0)
    for name in ["qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "lara_mini", "qwen4_exp"]:
        kernel = getattr(importlib.import_module(f"transformers.models.{name}.modeling_{name}"), gated_delta.KERNEL)
        for dtype in (torch.float32, torch.float64):
            q, k = (torch.randn(2, 83, 2, 8, generator=g, dtype=dtype) for _ in range(2))
            v = torch.randn(2, 83, 4, 12, generator=g, dtype=dtype)
            decay, beta = (
                -torch.rand(2, 83, 4, generator=g, dtype=dtype),
                torch.rand(2, 83, 4, generator=g, dtype=dtype),
            )
            for start in (None, torch.randn(2, 4, 8, 12, generator=g, dtype=dtype)):
                want = kernel(q, k, v, g=decay, beta=beta, chunk_size=32, initial_state=start, output_final_state=True,
                              use_qk_l2norm_in_kernel=True)  # fmt: skip
                prepared = gated_delta.prepare(q, k, v, decay, beta, 32, True)
                got = gated_delta.scan(prepared, start, True, dtype)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"{name} {dtype}"


def test_mamba1_scan_continues_from_the_passed_state():
    """patches/mamba1.py: Mamba1's scan always starts from zero; inside a chain it adds the received state's
    share, so a sequence scanned in two parts equals one scan (fp64, output and last state)."""

    from hf_contextpar.patches import mamba1
    from transformers.models.jamba import modeling_jamba

    from hf_contextpar.cache import recurrent

    g = torch.Generator().manual_seed(0)
    b, d, n, t, cut = 2, 6, 4, 19, 8
    x, dt, z = (torch.randn(b, d, t, generator=g, dtype=torch.float64) for _ in range(3))
    A = -torch.rand(d, n, generator=g, dtype=torch.float64)
    B, C = (torch.randn(b, n, t, generator=g, dtype=torch.float64) for _ in range(2))
    D, bias = torch.randn(d, generator=g, dtype=torch.float64), torch.randn(d, generator=g, dtype=torch.float64)
    scan = modeling_jamba.mamba_selective_scan
    kw = dict(delta_bias=bias, delta_softplus=True, return_last_state=True)
    whole, last = scan(x, dt, A, B, C, D, z, **kw)
    _, h = scan(x[..., :cut], dt[..., :cut], A, B[..., :cut], C[..., :cut], D, z[..., :cut], **kw)
    wrapped = mamba1._continued(scan)
    part = (x[..., cut:], dt[..., cut:], A, B[..., cut:], C[..., cut:], D, z[..., cut:])
    chain = recurrent.StateChain(None, None, receive=False, send=False)
    chain.current, chain.received = 3, {(3, 0): h}
    token = recurrent._running.set(chain)
    try:
        tail, tail_last = wrapped(*part, **kw)
    finally:
        recurrent._running.reset(token)
    assert (tail - whole[..., cut:]).abs().max() < 1e-12 and (tail_last - last).abs().max() < 1e-12
    zero, _ = wrapped(*part, **kw)  # outside a chain: transformers' scan, from zero
    assert torch.equal(zero, scan(*part, **kw)[0]) and (zero - whole[..., cut:]).abs().max() > 1e-3


def test_mamba1_per_head_scans_continue_from_their_heads_state():
    """Zamba scans each of its n_mamba_heads apart, in head order, from one (batch, heads, head_dim, state) state:
    inside its mixer's head loop, the k-th scan continues from head k's share; outside that loop, refused."""

    from hf_contextpar.patches import mamba1
    from transformers.models.jamba import modeling_jamba  # Zamba's scan is the same code (importing it: 6 s)

    from hf_contextpar.cache import recurrent
    from hf_contextpar.errors import PatchStateError

    g = torch.Generator().manual_seed(1)
    heads, b, d, n, t, cut = 3, 2, 4, 5, 13, 6
    x, dt, z = (torch.randn(heads, b, d, t, generator=g, dtype=torch.float64) for _ in range(3))
    A = -torch.rand(heads, d, n, generator=g, dtype=torch.float64)
    B, C = (torch.randn(heads, b, n, t, generator=g, dtype=torch.float64) for _ in range(2))
    scan = modeling_jamba.mamba_selective_scan
    kw = dict(delta_softplus=True, return_last_state=True)
    whole = [scan(x[k], dt[k], A[k], B[k], C[k], None, z[k], **kw) for k in range(heads)]
    h = torch.stack([scan(*(v[k, ..., :cut] for v in (x, dt)), A[k], B[k, ..., :cut], C[k, ..., :cut], None,
                          z[k, ..., :cut], **kw)[1] for k in range(heads)], dim=1)  # fmt: skip
    wrapped = mamba1._continued(scan)

    class Mixer:
        def forward(self):
            return [
                wrapped(x[k, ..., cut:], dt[k, ..., cut:], A[k], B[k, ..., cut:], C[k, ..., cut:], None, z[k, ..., cut:], **kw)
                for k in range(heads)
            ]  # fmt: skip

    chain = recurrent.StateChain(None, None, receive=False, send=False)
    chain.current, chain.received = 1, {(1, 0): h}
    token = recurrent._running.set(chain)
    try:
        tails = mamba1._head_loop(Mixer.forward)(Mixer())
        with pytest.raises(PatchStateError, match="outside its mixer's head loop"):
            Mixer().forward()
    finally:
        recurrent._running.reset(token)
    for (tail, tail_last), (out, last) in zip(tails, whole):
        assert (tail - out[..., cut:]).abs().max() < 1e-12 and (tail_last - last).abs().max() < 1e-12


def _inkling_cache():
    """A cache of Inkling's hybrid layers (K/V and 4 conv states each: on K and V before the attention, on its output
    and the MLP's after it)."""
    config = AutoConfig.for_model("inkling_text", **_known(tiny_config("inkling_text")))
    return ChainCache(config=config)


def _inkling_layer(cache, layer_idx):
    """One Inkling layer's cache calls in its order: the K/V convs, the K/V update, the attention-output and MLP
    convs (each conv reads its state first, as InklingShortConvolution does)."""
    for idx in (0, 1, "kv", 2, 3):
        if idx == "kv":
            cache.update(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16), layer_idx)
        else:
            cache.get_conv_state(layer_idx, idx)
            cache.update_conv_state(torch.full((1, 8, 3), float(idx)), layer_idx, idx, conv_kernel_size=4)


def test_an_attended_layers_later_states_go_at_their_writes():
    """A hybrid layer that writes states before and after its attention (Inkling's) is not left at its K/V update:
    what it wrote goes then (more to follow), each later state at its write, and an empty message closes it when the
    forward leaves it. The next rank takes each message where it first reads that state, so none waits on a state
    written after rank - 1's attention before its own attention runs."""
    comm = _Sends()
    cache = _inkling_cache()
    begin_chain(cache, comm, receive=False, send=True)
    _inkling_layer(cache, 0)
    assert [more for _, more in comm.headers()] == [True, True, True]
    sent = {k: t for states in comm.states() for k, t in states.items()}
    assert [set(s) for s in comm.states()] == [{(0, 0), (0, 1)}, {(0, 2)}, {(0, 3)}]
    cache.get_conv_state(1, 0)  # the next layer: layer 0's closing message, empty
    assert comm.headers()[-1] == (1, False)
    cache.context.chain.abandon()
    receiver = _Receives()
    receiver.queue = [t for _, t in comm.posted]  # as posted (the empty message: a header alone)
    cache = _inkling_cache()
    begin_chain(cache, receiver, receive=True, send=False)
    for idx in (0, 1):
        assert torch.equal(cache.get_conv_state(0, idx), sent[0, idx])
    cache.update(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16), 0)
    assert len(receiver.queue) == 5  # the attention runs before anything sent after rank - 1's
    assert torch.equal(cache.get_conv_state(0, 2), sent[0, 2]) and len(receiver.queue) == 3
    cache.context.chain.leave_layer()
    assert receiver.queue == []
    cache.context.chain.abandon()


def _xlstm_backend(chunk: int):
    """A tiny xLSTM's first mLSTM backend (the census's sizes) with chunks of `chunk`, and its heads' sizes."""
    config = AutoConfig.for_model(
        "xlstm", hidden_size=128, num_heads=2, qk_dim_factor=0.5, num_hidden_layers=1, vocab_size=64, chunk_size=chunk
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()
    return model.backbone.blocks[0].mlstm_layer.mlstm_backend, config.qk_head_dim, config.v_head_dim


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("length, segment", [(22, 22), (22, 10), (9, 9)])
def test_xlstm_ranks_run_each_token_on_one_process_kernel(world, length, segment):
    """patches/xlstm.py: one process runs a forward's whole chunks with the chunkwise kernel (fp64 here) and its last
    tokens with the sequence kernel, whose state and outputs are float32 even in an fp64 model, per piece of
    max_inference_chunksize tokens (`segment`). A rank runs each of its tokens on the kernel one process runs it
    with, from the state the rank before passed: fp64-exact as shipped (no Fp64Internals), where the backend run on
    each partition as a forward of its own is float32-far. 9 tokens at N = 4: partitions of 2 and 3, inside a chunk."""
    from hf_contextpar.patches import xlstm

    chunk = 4
    backend, dk, dv = _xlstm_backend(chunk)
    g = torch.Generator().manual_seed(world)
    shape = (2, 2, length)
    q, k = (torch.randn(*shape, dk, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(*shape, dv, generator=g, dtype=torch.float64)
    i, f = (torch.randn(*shape, generator=g, dtype=torch.float64) * 2 for _ in range(2))
    zeros = (torch.zeros(2, 2, dk, dv), torch.zeros(2, 2, dk), torch.zeros(2, 2, 1))
    zeros = tuple(z.double() for z in zeros)

    def one_forward(lo, hi, state):  # the backend's own inference path, as xLSTMModel calls it for a piece
        h, state = backend(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], i[:, :, lo:hi], f[:, :, lo:hi], *state)
        return h, tuple(t.double() for t in state)  # one process's cache keeps them in the model's dtype

    with torch.no_grad():
        state, want = zeros, []
        for lo in range(0, length, segment):
            h, state = one_forward(lo, min(lo + segment, length), state)
            want.append(h)
        want = torch.cat(want, 2)
        parts = torch.arange(length).tensor_split(world)
        state, got, naive = zeros, [], []
        for part in parts:
            a, b = int(part[0]), int(part[-1]) + 1
            run = xlstm._Forward(None, xlstm._pieces(a, b, length, chunk, segment), torch.float64, torch.float64)
            h, state = xlstm._scan(backend, run, tuple(x[:, :, a:b] for x in (q, k, v, i, f)), state)
            got.append(h)
        state = zeros
        for part in parts:
            h, state = one_forward(int(part[0]), int(part[-1]) + 1, state)
            naive.append(h)
    diff = (torch.cat(got, 2) - want).abs().max().item()
    assert diff < 1e-12, f"N={world}: the ranks' outputs are {diff:.2e} from one process's"
    # a partition's own forward moves tokens between the kernels (no partition boundary on the chunk grid here)
    assert (torch.cat(naive, 2) - want).abs().max().item() > 1e-9


def test_xlstm_pieces_cover_a_partition_on_one_process_grid():
    """patches/xlstm.py `_pieces`: the tokens [start, stop) of a forward, each once, in order; chunkwise pieces on
    the grid of their segment (a cut chunk as a chunk of its own), a segment's last tokens on the sequence kernel,
    a 1-token segment on the step kernel, and a new segment marked where one process read its cache."""
    from hf_contextpar.patches.xlstm import _pieces

    pieces = _pieces(5, 27, 30, 4, 12)  # segments [0, 12), [12, 24), [24, 30); chunks of 4 from each segment's start
    assert [(lo + 5, hi + 5, kernel, size, new) for lo, hi, kernel, size, new in pieces] == [
        (5, 8, "chunk", 3, False),
        (8, 12, "chunk", 4, False),
        (12, 24, "chunk", 4, True),
        (24, 27, "chunk", 3, True),
    ]
    assert _pieces(0, 10, 10, 4, 10) == ((0, 8, "chunk", 4, False), (8, 10, "sequence", 2, False))
    assert _pieces(0, 1, 13, 4, 12)[0][2] == "chunk" and _pieces(12, 13, 13, 4, 12) == ((0, 1, "step", 1, True),)


def test_xlstm_a_cache_under_a_name_it_ignores_is_no_cache():
    """xLSTM's forward takes its cache as `cache` (or the alias `cache_params`); `past_key_values` lands in its
    **kwargs, ignored on one process, which then makes its own bfloat16 cache for its pieces when use_cache is off.
    The patch reads the caller the same way (the fuzz's N = 3 case with past_key_values was 4.8e-3 off before)."""
    from hf_contextpar.patches import xlstm

    model = AutoModelForCausalLM.from_config(tiny_config("xlstm"))
    for kwargs, fresh in (
        ({"past_key_values": object(), "use_cache": False}, True),
        ({"cache_params": object(), "use_cache": False}, False),
        ({"cache": object(), "use_cache": False}, False),
        ({"use_cache": True}, False),
    ):
        xlstm._caller(model, (), kwargs)
        assert xlstm._fresh.get() is fresh, kwargs
    xlstm._fresh.set(False)
