"""DeepSeek-V4's compressed attention (CSA, HCA) under context parallelism (docs/design.md, "Compressed attention").

Every V4 attention layer attends over its sliding window's K=V and, on CSA / HCA layers, over the entries its
compressors made (one per 4 or 128 tokens) under a `block_bias` of their own. Three things make that one
process's result on a rank of a contiguous span (the chain's partitions):

- `CompressedLayer`, the rank's cache layer for a CSA / HCA layer: this rank's share of the window's K=V
  (`ShardedLayer`, stored once), V4's compressor API (`store_compression_weights`, `update_overlap_state`,
  `update_compressor_states`), and the unfinished group passed down the ranks in a chained prefill: rank r's
  first touch of a compressor receives what rank r - 1 left (`buffer_kv`, `buffer_gate`, CSA's `overlap_kv` /
  `overlap_gate`, `entry_count`) and sends its own on once its entries are made. The last rank's go to every rank
  after the prompt (`share_final_states`), so decode runs every compressor on every rank from the same state.
- The entries, to every rank: `update_compressor_states` gathers every rank's kept entries and returns them whole
  in global order, so the model's own `block_bias` and indexer (its top-k ties included) are one process's. A rank
  keeps the entries made in its span of a chained prefill, else (decode, a short prompt every rank runs) every
  N-th: the entries are 1/N per rank.
- `apply` has the attention take no mask (V4 concatenates `block_bias` to a tensor mask; the algorithms read the
  padding from the plan) and records each compressor's (entries, `block_bias`) for the attention adapter, which
  attends the window by the plan's algorithm and the entries locally, then merges (attention/entries.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_contextpar.attention import current_step, entries
from hf_contextpar.cache import recurrent
from hf_contextpar.cache.layers import ChainedLayer, ChainedLayerFactory
from hf_contextpar.cache.sharded import FAMILY_LAYERS
from hf_contextpar.errors import PatchStateError

_FIELDS = ("buffer_kv", "buffer_gate", "overlap_kv", "overlap_gate")  # then entry_count, as a float64 number


@dataclass(frozen=True)
class Compressed(ChainedLayerFactory):
    """What a rank's cache holds for one of V4's compressed layers (made like the template cache's layer)."""

    rate: int
    names: tuple

    def __call__(self, layout, window):
        return CompressedLayer(layout, window, self.rate, self.names)


class CompressedLayer(ChainedLayer):
    """This rank's share of a CSA / HCA layer: the window's K/V (a ShardedLayer's) and the compressors' state, which
    pass down the ranks (ChainedLayer)."""

    def __init__(self, layout, window, rate: int, names: tuple):
        super().__init__(layout, window)
        self.compress_rate, self.names = rate, names
        self._empty()

    def lazy_initialization(self, key_states, value_states):
        """K=V (V4's one head is its keys and its values, the same tensor): stored once, a (1, B, 1, T, D) block whose
        keys and values (`unpack_kv` with no key_dim) are one view, as V4's own cache layer aliases them."""
        super().lazy_initialization(key_states, value_states)
        if value_states is key_states:
            self.kv = self.kv[:1]
            self._keep(0)

    def _empty(self):
        for f in _FIELDS:
            setattr(self, f, dict.fromkeys(self.names))
        self.entry_count = dict.fromkeys(self.names, 0)
        self.kept = dict.fromkeys(self.names)  # (B, k, D): the entries this rank keeps
        self.kept_ids = {n: torch.zeros(0, dtype=torch.long) for n in self.names}  # their indices, ascending

    # -- the unfinished group, down the chain -----------------------------------------------
    def states(self, name: str) -> dict:
        """{(field, 0): tensor} of a compressor's state between forwards (what the next span continues from)."""
        out = {(i, 0): getattr(self, f)[name] for i, f in enumerate(_FIELDS) if getattr(self, f)[name] is not None}
        out[len(_FIELDS), 0] = torch.tensor([float(self.entry_count[name])], dtype=torch.float64)
        return out

    def load(self, name: str, states: dict):
        for i, f in enumerate(_FIELDS):
            getattr(self, f)[name] = states.get((i, 0))
        self.entry_count[name] = int(states[len(_FIELDS), 0].item())

    def chained_states(self) -> list:
        """Every compressor's state, in order: for `states.share_final_states`."""
        return [self.states(name) for name in self.names]

    def load_chained_states(self, states: list):
        for name, s in zip(self.names, states):
            self.load(name, s)

    def _receive(self, name: str, device):
        chain = recurrent.running_chain()
        if chain is None or not chain.receive:
            return
        seen = chain.__dict__.setdefault("compressed", set())  # once per compressor and forward
        if (id(self), name) not in seen:
            seen.add((id(self), name))
            self.load(name, {k: t.to(device) for k, t in chain.receive_states(device).items()})

    # -- V4's compressor API (DeepseekV4HCACache / DeepseekV4CSACache's, continued across ranks) ---------------
    def store_compression_weights(self, name: str, kv: torch.Tensor, gate: torch.Tensor):
        self._receive(name, kv.device)
        first_window_position = self.entry_count[name] * self.compress_rate
        buffered_kv, buffered_gate = self.buffer_kv[name], self.buffer_gate[name]
        if buffered_kv is not None and buffered_kv.shape[1]:
            kv = torch.cat([buffered_kv, kv], dim=1)
            gate = torch.cat([buffered_gate, gate], dim=1)
        usable = (kv.shape[1] // self.compress_rate) * self.compress_rate
        self.buffer_kv[name], self.buffer_gate[name] = kv[:, usable:], gate[:, usable:]
        return kv[:, :usable], gate[:, :usable], first_window_position

    def update_overlap_state(self, name: str, chunk_kv: torch.Tensor, chunk_gate: torch.Tensor, head_dim: int):
        prior_kv, prior_gate = self.overlap_kv[name], self.overlap_gate[name]
        self.overlap_kv[name] = chunk_kv[:, -1, :, :head_dim].clone()
        self.overlap_gate[name] = chunk_gate[:, -1, :, :head_dim].clone()
        return prior_kv, prior_gate

    def update_compressor_states(self, name: str, compressed: torch.Tensor) -> torch.Tensor:
        """This forward's new entries in; every entry so far (B, C, D) out, in global order (every rank's)."""
        step = current_step.get()
        if step is None or self.context is None:
            raise PatchStateError(
                "this ShardedCache holds one rank's share of a context-parallel cache and works only with the "
                "patched model; after remove_context_parallel, start again without it (or with a new cache)."
            )
        first, n = self.entry_count[name], compressed.shape[1]
        self.entry_count[name] += n
        chain = recurrent.running_chain()
        if chain is not None and chain.send:  # final now: the next rank's span continues from it
            chain.send_states({k: t.to(compressed.device) for k, t in self.states(name).items()}, compressed.device)
        ids, comm = torch.arange(first, first + n), step.comm
        # a chained rank made its span's entries alone; else every rank made the same ones, each gives every N-th
        mine = torch.ones_like(ids, dtype=torch.bool) if chain is not None else ids % comm.world == comm.rank
        held = self.kept[name] if self.kept[name] is not None else compressed[:, :0]
        held = torch.cat([held, compressed[:, mine.to(compressed.device)]], dim=1)
        full = self._gather(comm, name, held, torch.cat([self.kept_ids[name], ids[mine]]))
        # every N-th entry stays on this rank, whichever rank made it: 1/N per rank, as the K/V
        self.kept[name] = full[:, comm.rank :: comm.world].clone()
        self.kept_ids[name] = torch.arange(full.shape[1])[comm.rank :: comm.world]
        return full

    def _gather(self, comm, name: str, held: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every rank's `held` entries (indices `ids`) in global order, each entry checked given once."""
        counts = comm.all_gather(torch.tensor([ids.numel()], device=held.device)).view(-1).tolist()
        b, _, d = held.shape
        blocks = comm.broadcast_blocks(held, [(b, c, d) for c in counts], op="entries")
        where = comm.broadcast_blocks(ids.to(held.device), [(c,) for c in counts], op="entries")
        total = sum(counts)  # a chained prefill's later ranks' entries too: the whole forward's, as one process's
        full = held.new_empty((b, total, d))
        seen = torch.zeros(total, dtype=torch.long)
        for block, at in zip(blocks, where):
            at = at.wait().cpu()
            if at.numel() and (int(at.max()) >= total or int(at.min()) < 0):
                seen[:] = 2  # refused below
                break
            full[:, at.to(full.device)] = block.wait().to(full.dtype)
            seen[at] += 1
        if not bool((seen == 1).all()):
            raise PatchStateError(
                f"the ranks' compressed entries ({name}) do not cover entries 0..{total - 1} once each: the ranks' "
                "caches disagree (a cache used by another group or a forward that failed on some ranks)."
            )
        return full

    # -- the cache API ------------------------------------------------------------------------
    def remember(self):
        """At a forward's start (ShardedCache.begin): its states, for `end_forward` if the forward fails. The forward
        replaces them, never writes into them, so copies of the dicts keep them."""
        self._before = {f: dict(getattr(self, f)) for f in (*_FIELDS, "entry_count", "kept", "kept_ids")}

    def end_forward(self, ok: bool):
        """At a forward's end: a failed one's states dropped (as the K/V's are), then the copies."""
        for f, states in getattr(self, "_before", {}).items() if not ok else ():
            setattr(self, f, states)
        self._before = {}

    def _map_states(self, fn):
        for f in (*_FIELDS, "kept"):
            states = getattr(self, f)
            for name, t in states.items():
                if t is not None:
                    states[name] = fn(t)

    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        self._map_states(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        self._map_states(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices):
        super().batch_select_indices(indices)
        self._map_states(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices])

    def reset(self):
        super().reset()
        self._empty()

    def nbytes(self) -> int:
        kept = sum(t.numel() * t.element_size() for t in self.kept.values() if t is not None)
        return (super().nbytes() if self.kv is not None else 0) + kept


def _register():
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

    FAMILY_LAYERS[v4.DeepseekV4HCACache] = lambda layer: Compressed(layer.compress_rate, tuple(layer.entry_count))
    FAMILY_LAYERS[v4.DeepseekV4CSACache] = FAMILY_LAYERS[v4.DeepseekV4HCACache]


try:
    _register()
except ImportError:  # a transformers without DeepSeek-V4
    pass


def apply(model):
    """Each attention takes no mask, and each compressor's (entries, block_bias) is recorded for the adapter."""
    patched = []
    for module in model.modules():
        if type(module).__name__ != "DeepseekV4Attention":
            continue
        forward = module.forward

        def no_mask(*args, _forward=forward, _module=module, **kwargs):
            kwargs["attention_mask"] = None  # the algorithms take the padding from the plan
            if _module.compressor is None:  # K=V alone (its compressor records the entries otherwise)
                entries.record(_module, None, None)
            return _forward(*args, **kwargs)

        module.forward = no_mask
        patched.append(module)
        if module.compressor is not None:
            compress = module.compressor.forward

            def recording(*args, _module=module, _compress=compress, **kwargs):
                keys, bias = _compress(*args, **kwargs)
                entries.record(_module, keys, bias)
                return keys, bias

            module.compressor.forward = recording
            patched.append(module.compressor)

    def undo():
        for m in patched:
            m.__dict__.pop("forward", None)
            entries.take(m)

    return undo
