"""CSPS's communication-efficient sparse attention (CSA, seed 003 sections 3.2.4-3.2.6): the definition.

An *approximate* prefill, opt in only (`apply_context_parallel(model, sparse=CSA(...))`). The prompt is
cut into N contiguous partitions (balanced by work by default, `partitions.weighted` with `SparseRun.pair_weights`;
even or a table when asked) placed on the ranks in topology order (rank = node x ranks per
node + local rank, as torchrun numbers them), so nearer tokens live on nearer ranks. For a query on
rank d, the keys of partition s belong to level 1 if s = d, else to the smallest topology group holding
both ranks: level 2 (the node), level 3 (the world, or the rack with three fields), ... A query attends
to every key of level 1 (causally) and to the *kept* keys of each earlier partition: at level v a
fraction `fractions[v]` of that partition's real (not padding) tokens, per sequence and KV head, the
ones with the highest importance. Level 2 keeps `keep`, each level above half the one below (CSPS's
"roughly inversely proportional to distance"). The kept sets are nested (a prefix of one ordering), so a
block pruned for a far level is a prefix of the block pruned for a near one.

Importance (CSPS: "a head uses the attention score from its previous layer"): after each attention
layer, each partition's keys are ordered by the attention the partition's last `observe` query rows
give them in that layer (softmax over the partition's own keys, causal, summed over the query heads of
the key's KV head), highest first, padding last. The next attention layer prunes with that order; the
first attention layer of the model (no previous scores) and the last one keep everything.

Everything else is exact: a prefill over a non-empty cache (a second turn, a chunked prefill) attends
to every cached token; the cache keeps every token's K/V, so decode over the sharded cache is exact.
Both the distributed algorithm (attention/csa.py) and the one-process reference (eval/csa_reference.py)
read this module, so they implement one definition.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ..errors import UnsupportedModelError


@dataclass(frozen=True)
class CSA:
    """The approximate mode's settings. keep: the fraction of an earlier partition's tokens level 2 keeps
    (each level above keeps half the one below), or one fraction per level from 2 up. topology: "AxB" (A
    nodes of B ranks; "AxBxC": racks x nodes x ranks), a tuple, or None to read it from the launcher
    (LOCAL_WORLD_SIZE ranks per node). observe: the query rows at the end of each partition whose attention
    ranks its keys."""

    keep: float | tuple = 1.0
    topology: str | tuple | None = None
    observe: int = 64

    def __post_init__(self):
        fractions = self.keep if isinstance(self.keep, tuple) else (self.keep,)
        if not fractions or any(isinstance(f, bool) or not isinstance(f, (int, float)) for f in fractions):
            raise ValueError(f"CSA keep must be a fraction in (0, 1] or a tuple of them, got {self.keep!r}.")
        if any(not 0 < f <= 1 for f in fractions) or list(fractions) != sorted(fractions, reverse=True):
            raise ValueError(
                f"CSA keep fractions must lie in (0, 1] and not grow with the level (a farther level keeps no "
                f"more than a nearer one), got {self.keep!r}."
            )
        if isinstance(self.observe, bool) or not isinstance(self.observe, int) or self.observe < 1:
            raise ValueError(f"CSA observe must be a positive int (query rows), got {self.observe!r}.")
        if self.topology is not None:
            _parse(self.topology)

    def save(self, path: str, **measured) -> str:
        """Write the settings (and what chose them) as JSON, for `CSA.load` and `--csa FILE`."""
        import json

        keep = list(self.keep) if isinstance(self.keep, tuple) else self.keep
        top = "x".join(map(str, self.topology)) if isinstance(self.topology, tuple) else self.topology
        with open(path, "w") as f:
            json.dump(dict(keep=keep, topology=top, observe=self.observe, **measured), f, indent=1)
        return path

    @staticmethod
    def load(path: str, topology=None) -> CSA:
        """Settings `save` wrote (csa-config's); `topology` replaces the file's where given."""
        import json

        with open(path) as f:
            saved = json.load(f)
        keep = tuple(saved["keep"]) if isinstance(saved["keep"], list) else saved["keep"]
        return CSA(keep=keep, topology=topology or saved.get("topology"), observe=saved.get("observe", 64))

    @staticmethod
    def parse(text: str, topology=None, observe: int = 64) -> CSA:
        """A command line's --csa: fractions ("0.8", or "0.9,0.5" level by level) or a file `save` wrote."""
        import os

        if os.path.isfile(text):
            return CSA.load(text, topology=topology)
        try:
            keep = tuple(float(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise ValueError(
                f"--csa takes keep fractions (0.8 or 0.9,0.5) or a csa-config file, got {text!r}"
            ) from None
        return CSA(keep=keep if len(keep) != 1 else keep[0], topology=topology, observe=observe)

    def resolved(self, world: int) -> CSA:
        """The topology as a tuple of group sizes (outermost first), read from the launcher where not given."""
        if self.topology is None:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
            sizes = (world // local, local) if local < world and world % local == 0 else (1, world)
        else:
            sizes = _parse(self.topology)
        if math.prod(sizes) != world:
            raise ValueError(
                f"CSA topology {'x'.join(map(str, sizes))} holds {math.prod(sizes)} ranks, but {world} run: give "
                f"topology='AxB' with A x B = {world} (A nodes of B ranks)."
            )
        return replace(self, topology=tuple(sizes))

    def levels(self, src: int, dst: int) -> int:
        """The level of rank src's partition for rank dst's queries (1: the same rank). Needs `resolved`."""
        if src == dst:
            return 1
        group = 1
        for level, size in enumerate(reversed(self.topology), start=2):
            group *= size
            if src // group == dst // group:
                return level
        raise AssertionError("ranks outside the topology")

    def fraction(self, level: int) -> float:
        """The fraction of a partition's real tokens kept at `level` (1.0 at level 1)."""
        if level == 1:
            return 1.0
        given = self.keep if isinstance(self.keep, tuple) else (self.keep,)
        if level - 2 < len(given):
            return float(given[level - 2])
        return float(given[-1]) / 2 ** (level - 1 - len(given))

    def used_levels(self) -> list:
        """The levels above 1 some pair of ranks has (a topology field of 1 adds none). Needs `resolved`."""
        return [v for v, size in enumerate(reversed(self.topology), start=2) if size > 1]

    @property
    def exact(self) -> bool:
        """Every level keeps every token: the exact result. Needs `resolved`."""
        return all(self.fraction(v) == 1.0 for v in self.used_levels())

    def describe(self) -> str:
        """One line for logs and the agreement: the topology and what each level keeps."""
        if not isinstance(self.topology, tuple):
            return f"CSA(topology={self.topology or 'launcher'}, keep={self.keep}, observe={self.observe})"
        keep = ", ".join(f"L{v}={self.fraction(v):g}" for v in self.used_levels())
        return f"CSA(topology={'x'.join(map(str, self.topology))}, keep {keep or 'all'}, observe={self.observe})"


def _parse(topology) -> tuple:
    if isinstance(topology, str):
        try:
            sizes = tuple(int(p) for p in topology.lower().split("x"))
        except ValueError:
            sizes = ()
    else:
        sizes = tuple(topology) if isinstance(topology, (tuple, list)) else ()
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"CSA topology must be like '2x2' (nodes x ranks per node), got {topology!r}.")
    return sizes


def kept_counts(valid: torch.Tensor | None, length: int, batch: int, fraction: float) -> torch.Tensor:
    """(B,) how many of a partition's tokens are kept at a level: ceil(fraction x its real tokens), per
    sequence. valid: (B, length) bool, False on padding, or None (nothing padded)."""
    real = valid.sum(-1).cpu() if valid is not None else torch.full((batch,), length)
    if fraction >= 1.0:
        return real.long()
    return torch.minimum(torch.ceil(real.double() * fraction).long(), real.long())


def importance_order(q, k, q_cols, k_cols, row_valid, key_valid, scale, softcap=None) -> torch.Tensor:
    """(B, Hkv, Tk) the key indices of one partition, most important first, padding last: by the attention
    the query rows q (B, H, Tq, D) at columns q_cols give the keys k (B, Hkv, Tk, D) at k_cols (softmax over
    these keys, causal by column, padding masked), summed over the rows (padding rows weigh 0) and the
    query heads of each KV head. Ties keep column order (a stable sort)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, h, tq, _ = q.shape
    hkv = k.shape[1]
    qg = q.to(acc).reshape(b, hkv, (h // hkv) * tq, q.shape[-1])
    s = torch.matmul(qg, k.to(acc).transpose(-1, -2)) * scale  # (B, Hkv, group x Tq, Tk)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.view(b, hkv, h // hkv, tq, -1)
    # only keys later than the first row's can be hidden from a row, and without padding only they are masked (in
    # place; the same scores as masking every key)
    first = _first_late(k_cols, q_cols) if key_valid is None else 0
    vis = (k_cols[first:].view(1, -1) <= q_cols.view(-1, 1)).to(q.device)  # (Tq, Tk - first)
    vis = vis.view(1, 1, 1, tq, -1)
    if key_valid is not None:
        vis = vis & key_valid.to(q.device).view(b, 1, 1, 1, -1)
    s[..., first:].masked_fill_(~vis, -math.inf)
    p = torch.softmax(s, dim=-1)
    if key_valid is not None or not _every_row_sees(q_cols, k_cols):  # a row that sees no key gives nothing
        p = p.nan_to_num(0.0)
    if row_valid is not None:
        p = p * row_valid.to(q.device, acc).view(b, 1, 1, tq, 1)
    score = p.sum(dim=(2, 3))  # (B, Hkv, Tk)
    if key_valid is not None:
        score = score.masked_fill(~key_valid.to(q.device).view(b, 1, -1), -math.inf)
    return torch.sort(score, dim=-1, descending=True, stable=True).indices


def _first_late(k_cols: torch.Tensor, q_cols: torch.Tensor) -> int:
    """Where k_cols (ascending) pass the earliest query column: every row sees the keys before it. 0 unless sorted."""
    if k_cols.numel() < 2 or q_cols.numel() == 0 or not bool((k_cols[1:] >= k_cols[:-1]).all()):
        return 0
    return int(torch.searchsorted(k_cols, q_cols.min().view(1), right=True))


def _every_row_sees(q_cols: torch.Tensor, k_cols: torch.Tensor) -> bool:
    """Without padding, does every query row see a key (the earliest one)? Then no row's softmax is 0 / 0."""
    return q_cols.numel() == 0 or (k_cols.numel() > 0 and int(q_cols.min()) >= int(k_cols.min()))


def observed_rows(length: int, observe: int) -> slice:
    """The query rows of a partition whose attention ranks its keys: its last `observe`."""
    return slice(max(0, length - observe), length)


def exact_layers(attending: list) -> frozenset:
    """The attention layers that keep every token: the model's first (no earlier scores) and its last."""
    return frozenset({attending[0], attending[-1]}) if attending else frozenset()


def full_layers(config) -> list:
    """The layers CSA prunes: full causal attention (a hybrid block's included). A sliding-window layer sees only
    its near past, which CSA keeps whole: it runs exact."""
    text = config.get_text_config(decoder=True)
    types = getattr(text, "layer_types", None)
    if not types:
        return [] if getattr(text, "sliding_window", None) else list(range(text.num_hidden_layers))
    return [i for i, t in enumerate(types) if t in ("full_attention", "hybrid")]


def refuse_layers(config, sinks: bool = False) -> None:
    """What CSA does not define: chunked attention, attention sinks (`sinks`: the model's attention modules hold
    learned sink logits, model/contract.py finds them; or its config asks for them), a latent (MLA) cache, K/V shared
    across layers, or no full-attention layer to prune (a family whose patch makes its layers attend otherwise:
    `refuse_family`). Refused at apply, with what to do."""
    text = config.get_text_config(decoder=True)
    why = []
    if "chunked_attention" in (getattr(text, "layer_types", None) or ()):
        why.append("chunked attention layers")
    if getattr(text, "kv_lora_rank", None):
        why.append("a latent (MLA) K/V cache")
    if getattr(text, "num_kv_shared_layers", 0):
        why.append("K/V shared across layers")
    if sinks or getattr(text, "use_sinks", False):
        why.append("attention sinks")
    if not full_layers(config):
        why.append("no full-attention layer (nothing to prune)")
    if why:
        raise UnsupportedModelError(
            f"sparse=CSA(...) prunes full causal attention layers (sliding-window ones run exact); this model has "
            f"{', '.join(why)}. Run it exact (leave sparse unset)."
        )


def refuse_family(family) -> None:
    """A family whose patch makes its attention layers attend otherwise (FamilyPatch.csa False: JetMoE's head
    experts, DiffLlama's value halves, HRM's cycles, Moshi's windowless sliding layers): CSA's pruning and its
    one-process reference are not defined for them. Refused at apply."""
    if family is not None and not family.csa:
        raise UnsupportedModelError(
            f"sparse=CSA(...) is not defined for {family.model_type} ({family.description}): its family patch "
            "makes its attention layers attend otherwise than CSA prunes. Run it exact (leave sparse unset)."
        )


def refuse_shared_modules(shared: list[str]) -> None:
    """`shared`: the model's attention modules that serve several layers (no layer index of their own: Zamba's and
    Zamba2's shared transformer block; model/contract.py finds them). CSA decides per layer which keys a layer keeps,
    and its one-process reference cannot tell that module's layers apart. Refused at apply, structurally (the fuzz
    found Zamba's pruned CSA off its reference by 1.28)."""
    if shared:
        raise UnsupportedModelError(
            f"sparse=CSA(...) decides per layer which keys each attention layer keeps; this model's {', '.join(shared)} "
            "has no layer index of its own (one module shared by several layers), so CSA cannot tell its layers "
            "apart. Run it exact (leave sparse unset)."
        )


def check(facts) -> SparseRun | None:
    """At apply (capabilities.py): what the forwards run of CSA where `sparse=CSA(...)` was asked for, else None. DCP
    splits a KV head's keys between TP ranks by slot, which CSA's per-rank pruning does not select over: refused. The
    model's layers and family are refused by the contract (model/contract.py: `refuse_layers`, `refuse_family`)."""
    csa = facts.settings.sparse
    if csa is None:
        return None
    if facts.dcp is not None:
        raise UnsupportedModelError(
            "sparse=CSA(...) is not supported with DCP (TP beyond the KV heads): use TP up to the KV heads."
        )
    return SparseRun.of(csa, facts.world, full_layers(facts.config))


@dataclass(frozen=True)
class SparseRun:
    """What a patched model's forwards read of its approximate mode: the settings, resolved at apply, and
    the attention layers that keep every token."""

    strategy: ClassVar[str] = "csa"  # the record (plan/strategies.py) a fresh prefill runs in this mode
    csa: CSA
    exact: frozenset  # attention layer indices
    last: int  # the last attention layer (no later layer reads its order)
    pruning: int = 0  # the full-attention layers that prune (every one but the exact ones)
    attending: tuple = ()  # the full-attention layers, in order

    @staticmethod
    def of(csa: CSA, world: int, attending: list) -> SparseRun:
        exact = exact_layers(attending)
        last = attending[-1] if attending else -1
        return SparseRun(csa.resolved(world), exact, last, len(set(attending) - exact), tuple(attending))

    def prunes(self, layer: int) -> bool:
        """Does full-attention layer `layer` prune (else it keeps every key)? A function of the layer alone, so a
        rank can size a layer's messages before it runs (posting its receives ahead)."""
        return layer in self.attending and layer not in self.exact

    def ranks_for(self, layer: int) -> bool:
        """Does the next full-attention layer after `layer` prune, so that it reads the importance order `layer`
        ranks its keys by? (The last one, and one before an exact layer, rank nothing: nothing reads it.)"""
        later = [a for a in self.attending if a > layer]
        return bool(later) and self.prunes(later[0])

    def pair_weights(self, world: int, layers: int) -> list:
        """[s][d]: the share of rank s's keys rank d's queries attend, averaged over the model's `layers` attention
        layers: every key at the layers that keep all (exact, sliding), the fraction its level keeps at the pruning
        ones (the work `partitions.weighted` balances; 1 where s >= d, which it does not read)."""
        csa, share = self.csa, self.pruning / max(layers, 1)
        return [
            [1 - share * (1 - csa.fraction(csa.levels(s, d))) if s < d else 1.0 for d in range(world)]
            for s in range(world)
        ]
