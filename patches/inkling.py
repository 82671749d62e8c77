"""Inkling (text): its relative-position bias as a score bias from global columns (hf_contextpar/attention/bias.py).

`InklingAttention` adds to head h's score of query q and key k the bias R[q, h, q - k] for 0 <= q - k < rel_extent
(0 beyond), where R = r_proj(hidden) @ proj is computed from the query token's hidden state
(`InklingRelativeLogits`), and on its full layers multiplies the query and that bias by a log scaling tau(q) of the
query's position (in fp32). The model numbers queries and keys from its cache's offsets, which under context
parallelism are neither a rank's queries' positions nor its keys'; the bias is per query row, so it stays with the
queries: under hf-contextpar's attention the patched forward hands a `RelativeBias` holding this rank's rows of R
(scaled as the model scales them) and reads each block's bias at its global columns, distance q - k. Strategies that
move queries to other ranks (pass-Q, Ulysses) would need R to travel with them and are refused. Its short
convolutions pass their states down the ranks (registered as chained): those on K and V are written before the
layer's attention, those on its output and the MLP after it, so the chain serves each layer as an attended one
(hf_contextpar/cache/recurrent.py). Under transformers' own attention the model's forward runs unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_contextpar.attention import current_step
from hf_contextpar.errors import UnsupportedModelError

from . import ported


@dataclass(frozen=True, eq=False)
class RelativeBias:
    """Bias R[row(q), h, q - k] for 0 <= q - k < extent, 0 beyond: R (B, H, Tq, extent) for this rank's queries, whose
    global columns are `q_cols` (the rows a query reads are found by its column). One per layer (eq=False)."""

    rows: torch.Tensor  # (B, H, Tq, extent) in the model's dtype
    q_cols: torch.Tensor  # (Tq,) this rank's query columns
    per_query = True  # the bias belongs to the query rows: an algorithm that moves queries cannot evaluate it

    def __call__(self, bias, q_cols, k_cols):
        lookup = torch.full((bias.length,), -1, dtype=torch.long, device=q_cols.device)
        lookup[self.q_cols.to(q_cols.device)] = torch.arange(self.q_cols.numel(), device=q_cols.device)
        index = lookup[q_cols]
        if bool((index < 0).any()):
            raise UnsupportedModelError("Inkling's relative bias was asked for queries of another rank")
        extent = self.rows.shape[-1]
        k = k_cols[None] if k_cols.dim() == 1 else k_cols  # (B | 1, Tk)
        distance = q_cols[None, :, None] - k[:, None, :]  # (B | 1, Tq, Tk)
        rows = self.rows[:, :, index.to(self.rows.device)]  # (B, H, Tq, extent)
        gather = distance.clamp(0, extent - 1)[:, None].expand(rows.shape[0], rows.shape[1], -1, -1)
        out = rows.gather(-1, gather.to(rows.device))
        return out.masked_fill(((distance < 0) | (distance >= extent))[:, None].to(out.device), 0.0)


def _forward(self, hidden_states, attention_mask, conv_mask=None, cache=None, **kwargs):
    """transformers' InklingAttention.forward (5.x) with its relative bias from global columns (hf-contextpar's
    attention only)."""
    kwargs.pop("past_key_values", None)
    if not ported.switched(self.config):
        return type(self).forward(self, hidden_states, attention_mask, conv_mask=conv_mask, cache=cache, **kwargs)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query = self.q_proj(hidden_states)
    key = self.k_sconv(self.k_proj(hidden_states), cache=cache, conv_mask=conv_mask)
    value = self.v_sconv(self.v_proj(hidden_states), cache=cache, conv_mask=conv_mask)
    relative_states = self.r_proj(hidden_states)
    query = self.q_norm(query.view(hidden_shape)).transpose(1, 2)
    key = self.k_norm(key.view(hidden_shape)).transpose(1, 2)
    value = value.view(hidden_shape).transpose(1, 2)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    q_cols = current_step.get().q_cols  # this rank's queries' global positions (the model numbers them so)
    rows = (relative_states.view(*input_shape, self.num_heads, -1) @ self.rel_logits_proj.proj).transpose(1, 2)
    if not self.is_sliding and self.config.log_scaling_n_floor is not None:  # the model's, in fp32
        effective_n = (q_cols.to(query.device) + 1).float()
        tau = 1.0 + self.config.log_scaling_alpha * torch.log(
            (effective_n / self.config.log_scaling_n_floor).clamp(min=1.0)
        )
        tau = tau.view(1, 1, -1, 1)
        query = (query.float() * tau).to(query.dtype)
        rows = (rows.float() * tau).to(rows.dtype)
    out, weights = ported.attend(
        self,
        query,
        key,
        value,
        attention_mask,
        sliding_window=self.sliding_window,
        score_bias=RelativeBias(rows, q_cols),
        **kwargs,
    )
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def apply(model):
    """Patch every InklingAttention of `model` (reversible); returns undo()."""
    return ported.port(model, "InklingAttention", _forward, lambda module: {})
