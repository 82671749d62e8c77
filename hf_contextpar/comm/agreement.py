"""Rank agreement: every decision that changes which collectives run is the same on every rank.

Once at apply (`agree_settings`: settings and model shape compared, machine facts taken from rank
0), before each forward (`RankCheck.inputs`: a fingerprint of the inputs, riding on the forward's
first collective) and after generate() (`RankCheck.outputs`: the returned sequences). A mismatch
is a `RankMismatchError` on every rank, never a hang or gloo's size abort.
"""

from __future__ import annotations

import operator

import numpy
import torch

from ..config import config_value
from ..errors import PeerFailureError, RankMismatchError
from ..settings import Settings

CHECK_LENGTH = 8


def fingerprint(t: torch.Tensor | None) -> int:
    """Cheap order-sensitive hash of a tensor's contents (0 for None)."""
    if t is None:
        return 0
    if t.is_floating_point():
        return int(t.double().sum().view(torch.int64)) ^ int((t.double().flatten()[::97] * 3.1).sum().view(torch.int64))
    return int_fingerprint([t])


def int_fingerprint(tensors) -> int:
    """One order-sensitive hash of integer tensors' contents, read as one vector v (1-based i): the sum of
    v_i * (i * 1000003 + 7919) in int64 arithmetic (wrapping). Callers fix the boundaries (the shapes go
    into the check beside it). This runs before every decode step, over a mask as long as the sequence:
    small tensors are summed in plain Python, each large one in one dot product against cached weights
    (no concatenation, no weights built per call); `_reference_fingerprint` is the same hash in tensor ops."""
    total, offset = 0, 0
    for t in tensors:  # a list of ints reads as a 1D tensor of them
        n = len(t) if isinstance(t, list) else t.numel()
        if n <= _SMALL:  # sum of v_j * (w + 1000003 * j), j = 1.., as two sums in C (no Python loop per element)
            values = t if isinstance(t, list) else _flat_list(t.long() if t.is_floating_point() else t)  # as int(v)
            total += (offset * 1000003 + 7919) * sum(values) + 1000003 * sum(map(operator.mul, values, range(1, n + 1)))
        elif n:
            t = torch.tensor(t, dtype=torch.long) if isinstance(t, list) else t
            v, w = t.reshape(-1), _weights(offset, n, t.device)
            v = v if v.dtype == torch.long else v.long()
            total += int(v.dot(w) if v.device.type == "cpu" else (v * w).sum())  # CUDA's dot takes floats only
        offset += n
    total &= (1 << 64) - 1  # as int64 wraps
    return total - (1 << 64) if total >= 1 << 63 else total


_SMALL = 32  # up to this many elements, tolist() and Python beat a tensor op


def _flat_list(t: torch.Tensor) -> list:
    """t's elements in order, as a list: tolist() flattened in Python (a reshape first would cost a tensor op)."""
    values = t.tolist()
    if t.dim() == 0:
        return [values]
    for _ in range(t.dim() - 1):
        values = [v for row in values for v in row]
    return values


_WEIGHTS: dict = {}  # device -> int64 weights i * 1000003 + 7919 for i = 1, 2, ... (grown by doubling)


def _weights(offset: int, n: int, device) -> torch.Tensor:
    """The fingerprint's weights of elements offset + 1 .. offset + n."""
    w = _WEIGHTS.get(device)
    if w is None or w.numel() < offset + n:
        size = max(4096, 2 * (offset + n))
        w = _WEIGHTS[device] = torch.arange(1, size + 1, device=device) * 1000003 + 7919
    return w[offset : offset + n]


def _reference_fingerprint(tensors) -> int:
    """int_fingerprint as its definition reads, in five tensor ops (what tests compare it with)."""
    flat = torch.cat(
        [(torch.tensor(t, dtype=torch.long) if isinstance(t, list) else t).reshape(-1).long() for t in tensors]
    )
    w = torch.arange(1, flat.numel() + 1, device=flat.device) * 1000003 + 7919
    return int((flat * w).sum())


def check_vector(values: list) -> torch.Tensor:
    """A rank-agreement check's message: always CHECK_LENGTH integers, so ranks that reach different
    checks (one decoding, one done) exchange equal sizes and see a mismatch. Gloo aborts the process
    on unequal all-gather sizes instead of raising."""
    # through numpy: torch.tensor(list) costs about three times as much, and this runs before every forward
    return torch.from_numpy(numpy.array(values + [0] * (CHECK_LENGTH - len(values)), dtype=numpy.int64))


def model_signature(model) -> tuple:
    text = model.config.get_text_config(decoder=True)
    p = next(model.parameters())
    return (
        text.model_type,
        text.num_hidden_layers,
        config_value(text, "num_attention_heads"),
        config_value(text, "num_key_value_heads"),
        config_value(text, "head_dim"),
        text.vocab_size,
        str(p.dtype),
        sum(q.numel() for q in model.parameters()),
    )


def agree_settings(settings, model, group, tp: tuple, dcp) -> Settings:
    """Make every decision that changes which collectives run the same on every rank, once, at apply,
    before the runtime is built; returns the agreed settings.

    Each rank's settings and model shape are compared (a mismatch is an error on every rank); the
    machine facts that drive per-call choices (the planner's calibration, KV-Runahead's partition
    table) are taken from rank 0, since each rank may have read a different file (the saved
    calibration) or none; how partitions are cut (even, balanced, a table) must be the same.
    Under tensor parallelism (tp: transformers' (TP group, TP size)) the ranks of each TP group compare
    first, then the CP group compares and learns whether any TP group disagreed: every rank of the
    (cp, tp) mesh meets every other's settings in two steps, and the facts come from global rank 0 (TP
    rank 0, then CP rank 0). dcp: mesh.dcp_of's (group, index, size) of the TP ranks sharing a KV head."""
    tp_group, tp_size = tp
    # DCP (the TP ranks sharing a KV head) adds collectives to every layer: all ranks run it or none
    mine = dict(settings.compared(), dcp=dcp[2] if dcp is not None else 1, model=model_signature(model) + (tp_size,))
    facts, clash = settings.facts(), None
    if tp_group is not None:
        peers = _gather_objects((mine, facts), tp_group)
        clash = _clash(mine, [p[0] for p in peers], "tensor-parallel")
        facts = peers[0][1]
    everyone = _gather_objects((mine, facts, clash), group)
    for r in everyone:  # a TP group's disagreement, reported on the CP ranks of every TP group
        if r[2] is not None:
            raise RankMismatchError(r[2])
    mismatch = _clash(mine, [e[0] for e in everyone], "context-parallel")
    if mismatch is not None:
        raise RankMismatchError(mismatch)
    return settings.with_facts(everyone[0][1])


def _gather_objects(obj, group) -> list:
    import torch.distributed as dist

    everyone = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(everyone, obj, group=group)
    except RuntimeError as e:  # a peer that failed before this point (its own arguments) or timed out
        raise PeerFailureError(
            f"apply_context_parallel: a peer rank did not reach the agreement step ({e}). Every rank must call "
            "apply_context_parallel with the same arguments (its error on that rank says what was wrong)."
        ) from e
    return everyone


def _clash(mine: dict, settings: list, kind: str) -> str | None:
    """The message for the first setting the ranks of a group disagree on, or None."""
    for key in mine:
        values = [s[key] for s in settings]
        if any(v != values[0] for v in values):
            return (
                f"apply_context_parallel got a different {key} on different {kind} ranks ({values}, by rank). Every "
                "rank must load the same model and call apply_context_parallel with the same arguments."
            )
    return None


class RankCheck:
    """The per-call checks that every rank got the same inputs and returned the same sequences."""

    def __init__(self, comm, tp_group=None):
        self.comm, self.tp_group = comm, tp_group

    def inputs(self, inputs):
        """Every rank's input fingerprint (model/contract.py's checked `Inputs`), compared before the forward's
        first message (see Comm.check_before_next: over shared memory it costs no collective of its own), with
        the integers that, besides the inputs, set the message sizes and the output gathers (`_sizing`)."""
        sizing = _sizing(inputs)
        # the integer inputs hashed as one vector; their sizes follow from the header (the mask's is
        # past + num_new, checked before, position_ids are (batch, num_new)), what is present from the
        # flags. Every rank's fingerprint must have the same length: it is all-gathered. A mask of ones alone
        # (decode's, as long as the sequence) is its width: the flag says which, so a padded mask on one rank
        # against ones on another still differs.
        ids, mask, position_ids = inputs.ids, inputs.mask, inputs.position_ids
        ones = mask is not None and inputs.padding is None  # the contract found ones alone (masks.ones_only)
        hashed = [t for t in (ids, [mask.shape[-1]] if ones else mask) if t is not None]
        at = position_ids.device
        ints = [t.to(at) if isinstance(t, torch.Tensor) and t.device != at else t for t in hashed]
        fp = check_vector(
            [
                inputs.batch,
                inputs.num_new,
                inputs.past,
                ids is not None,
                0 if mask is None else 2 if ones else 1,
                len(sizing),
                int_fingerprint([*ints, position_ids, [int(v) for v in sizing]]),
                fingerprint(inputs.embeds),
            ]
        )
        device = _check_device(ids if ids is not None else inputs.embeds)
        fp = fp if device == "cpu" else fp.to(device)
        if self.tp_group is not None:  # before the model runs: its first collective is a TP one
            self.across_mesh(fp, "inputs")
        else:
            self.comm.check_before_next(fp, lambda everyone: self.verify(everyone, "inputs"))

    def outputs(self, sequences: torch.Tensor):
        """After generate(): every rank must hold the same sequences (covers what was sampled after
        the last forward, which no forward's input check sees)."""
        # -1 first, which no input check has: a rank still decoding meets a mismatch, not a size error
        fp = check_vector([-1, *sequences.shape, fingerprint(sequences)]).to(_check_device(sequences))
        if self.tp_group is not None:
            self.across_mesh(fp, "generated sequences")
        else:
            self.verify(self.comm.all_gather(fp, tag="control"), "generated sequences")

    def across_mesh(self, fp: torch.Tensor, what: str):
        """The check over every rank of the (cp, tp) mesh, in two all-gathers: the TP group's, then the
        CP group's carrying whether each rank's TP group agreed, so a disagreement anywhere is an error
        on every rank (each CP group holds one rank of every TP group)."""
        import torch.distributed as dist

        peers = [torch.empty_like(fp) for _ in range(dist.get_world_size(self.tp_group))]
        try:
            dist.all_gather(peers, fp, group=self.tp_group)
        except RuntimeError as e:
            raise PeerFailureError(f"a tensor-parallel peer rank failed or did not answer ({e}).") from e
        agreed = all(bool(torch.equal(p, peers[0])) for p in peers)
        everyone = self.comm.all_gather(torch.cat([fp, fp.new_tensor([int(agreed)])]), tag="control")
        if not bool(everyone[:, -1].all()):
            raise RankMismatchError(
                f"tensor-parallel ranks got different {what} (a TP group's ranks differ: batch, length, cache length, "
                "token contents or output arguments). Every rank of the (cp, tp) mesh must call the model with the "
                "same prompt, mask, cache and arguments, and generate() with the same settings; for sampling, seed "
                "every rank identically."
            )
        self.verify(everyone[:, :-1], what)

    def verify(self, everyone, what: str):
        rows = everyone.tolist()  # a few integers per rank: compared in Python, no tensor op per comparison
        if any(row != rows[0] for row in rows):
            bad = [r for r, row in enumerate(rows) if row != rows[0]]
            raise RankMismatchError(
                f"context-parallel ranks got different {what} (ranks {bad} differ from rank 0: batch, length, "
                "cache length, token contents or output arguments). Every rank must call the model with the same "
                "prompt, mask, cache, logits_to_keep, return_dict and output_hidden_states, and generate() with the "
                "same settings; for sampling, seed every rank identically (e.g. torch.manual_seed(s) on all ranks)."
            )


def _sizing(inputs) -> list:
    """What, besides the inputs, sets a forward's message sizes (the cache's sliding state, `ShardedCache.sizing`)
    and its output gathers (return_dict, hidden states, logits_to_keep)."""
    keep = inputs.logits_to_keep
    keep = keep.flatten().tolist() if isinstance(keep, torch.Tensor) else [keep]
    hidden = inputs.output_hidden_states
    cache = inputs.cache.sizing() if inputs.cache is not None else []
    return cache + [inputs.as_tuple, hidden is None, bool(hidden), *keep]


def _check_device(t):
    return t.device if t is not None and t.device.type == "cuda" else "cpu"
