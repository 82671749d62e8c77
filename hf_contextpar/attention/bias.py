"""Score biases from global columns: an additive term on a layer's attention scores that every rank evaluates for
its own blocks, so the bias never travels.

A family whose attention adds a bias a function of the query's and key's positions (ALiBi: a per-head slope times
the key's position; a relative-position bias by distance) hands its attention a `fn` (the keyword `score_bias=`):
`fn(bias, q_cols, k_cols) -> tensor` broadcastable to (B, H, Tq, Tk), `q_cols` (Tq,) and `k_cols` (Tk,) or (B, Tk)
global columns (an empty slot of batched decode reads column 0: it is masked), `bias` the `ScoreBias` below with the
forward's global facts (its length, its padding for the sequences being attended, a memo for what the forward
computes once). A bias computed from the keys' values (`fn.reads_values`: Doge's per-key bias) gets the tile's
values as a fourth argument: they travel with their keys, so the bias does too, as one more function of the block.
The term is added to the scaled (and soft-capped) scores before the softmax, as the family's own attention adds it,
so `fn` must compute exactly the family's formula: its values, not a shift of them, enter the LSE that merges the
blocks. Ulysses attends a slice of the heads (`heads`), batched decode a subset of the sequences (`rows`): the bias
is narrowed the same way. `fn` must be hashable (a frozen dataclass): one `ScoreBias` serves every layer of a
forward that hands an equal `fn` (`for_forward`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import UnsupportedInputError


@dataclass(frozen=True, eq=False)
class ScoreBias:
    fn: object  # fn(bias, q_cols, k_cols) -> (B | 1, H | 1, Tq | 1, Tk): the family's formula
    length: int  # the forward's global key columns (past + new): where a bias relative to the last key starts
    padding: torch.Tensor | None  # (B, length) bool, False on padding, for the sequences attended; None: unpadded
    heads: tuple | None = None  # (start, stop) of the query heads attended (Ulysses: this rank's); None: all
    memo: dict = field(default_factory=dict)  # what fn computes once per forward (positions from the padding)

    def rows(self, rows) -> ScoreBias:
        """The bias of a subset of the sequences (batched decode: rows an index or slice of the batch)."""
        padding = None if self.padding is None else self.padding[rows]
        return ScoreBias(self.fn, self.length, padding, self.heads)

    def head_slice(self, start: int, stop: int) -> ScoreBias:
        """The bias of query heads [start, stop) (Ulysses: a rank attends H / N heads of every token)."""
        return ScoreBias(self.fn, self.length, self.padding, (start, stop), self.memo)

    def block(self, q_cols: torch.Tensor, k_cols: torch.Tensor, dtype, device, values=None) -> torch.Tensor:
        """The bias of one tile: (B | 1, H | 1, Tq | 1, Tk) in `dtype`, for the attended heads. `values`: the tile's
        keys' values (B, Hkv, Tk, D), handed to a bias computed from them (`fn.reads_values`: Doge's)."""
        extra = (values,) if getattr(self.fn, "reads_values", False) else ()
        bias = self.fn(self, q_cols.to(device), k_cols.to(device).clamp(min=0), *extra)
        while bias.dim() < 4:
            bias = bias.unsqueeze(0)
        if bias.shape[1] > 1 and self.heads is not None:
            bias = bias[:, self.heads[0] : self.heads[1]]
        return bias.to(dtype)


def for_forward(step, fn) -> ScoreBias:
    """The forward's `ScoreBias` for `fn` (one for every layer that hands an equal fn), checked against the family's
    longest sequence (`fn.max_length`, where it has one) before any message: every rank refuses alike."""
    limit = getattr(fn, "max_length", None)
    length = step.plan.seq_length
    if limit is not None and length > limit:
        raise UnsupportedInputError(
            f"this forward attends over {length} tokens, but the model's score bias is defined for at most {limit} "
            f"({type(fn).__name__}; one process fails there too): raise the config's limit or shorten the input."
        )
    key = ("score_bias", fn)
    if key not in step.state:
        step.state[key] = ScoreBias(fn, length, step.plan.padding)
    return step.state[key]


def rows_of(bias: ScoreBias | None, rows) -> ScoreBias | None:
    return None if bias is None else bias.rows(rows)
