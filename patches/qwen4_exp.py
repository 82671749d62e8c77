"""Qwen4-Exp (text): QSA, a block indexer that hands its top-k as the indexer's mask narrowed to the kept keys.

Its attention gets no `indices=`: the indexer's (B, 1, Tq, T) bool mask (what the library's mask function gave it,
attention/indexed.py) comes back with the unselected blocks' keys turned off. That mask, inside the indexer's, is the
layer's selection (B, Tq, T), which the algorithms intersect with each block's visibility as any DSA top-k."""

from __future__ import annotations

import torch

from hf_contextpar.model.families import FamilyHooks


class NarrowedMask(FamilyHooks):
    def selection(self, module, attention_mask, indexer_mask):
        if indexer_mask is None or attention_mask is indexer_mask or not isinstance(attention_mask, torch.Tensor):
            return None
        if attention_mask.dtype != torch.bool or attention_mask.shape != indexer_mask.shape:
            return None
        if bool((attention_mask & ~indexer_mask.to(attention_mask.device)).any()):  # a key the indexer's hid
            return None
        return attention_mask[:, 0]


HOOKS = NarrowedMask()
