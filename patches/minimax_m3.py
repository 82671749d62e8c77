"""MiniMax-M3 (text): block-sparse attention whose lightning indexer hands its top key blocks as `block_indices`.

Its `minimax_m3_sparse` layers' indexer scores every earlier key slot against one head of index keys (kept on the
layer's cache layer by `update_index`, which the sharded cache answers with every column's, attention/indexed.py),
max-pools the scores over blocks of `index_block_size` slots counted from the cache's first slot, and passes each
query's top `index_topk_blocks` blocks per KV head to its attention as `block_indices` (B, H_kv, Tq, k), -1 for an
unused slot. A rank's indexer thus sees the whole row, so its blocks are one process's; slot = global column, so the
blocks are global columns in runs of `index_block_size`, which the engine expands (`indexed.block_selection`)."""

from __future__ import annotations

import torch

from hf_contextpar.errors import UnsupportedInputError
from hf_contextpar.model.families import FamilyHooks


class BlockIndices(FamilyHooks):
    def check_mask(self, model, mask, num_new: int) -> None:
        """Its blocks are anchored to key slots, its queries to positions (transformers' own TODO: only right
        padding is equivalent to an unpadded run). A token at slot s, position p (the mask's count of tokens before
        it, as generate() numbers them) always keeps block p // index_block_size; where that block holds no real
        key at or before s, its kept blocks can hold padding only, and one process then attends it uniformly over
        every key, future ones too (its fully masked row of the additive mask), which no sharded attention
        reproduces. Refused before any collective; every other mask runs as one process runs it."""
        text = model.config.get_text_config(decoder=True)
        if "minimax_m3_sparse" not in (text.layer_types or ()):
            return
        width, real = text.index_block_size, mask != 0
        seen = real.long().cumsum(-1)  # real tokens up to each slot
        start = (seen - 1).clamp(min=0) // width * width  # the first slot of each token's own block
        end = torch.minimum(start + width - 1, torch.arange(mask.shape[-1], device=mask.device))
        before = torch.where(start > 0, seen.gather(-1, (start - 1).clamp(min=0)), torch.zeros_like(seen))
        if bool((real & (seen.gather(-1, end) == before)).any()):
            raise UnsupportedInputError(
                f"attention_mask has a token whose own key block ({width} slots, index_block_size) holds only "
                f"padding: {type(model).__name__}'s sparse layers anchor their key blocks to cache slots and its "
                "queries to positions, so that token's kept blocks can hold padding only, where one process "
                f"averages every key uniformly, future ones included. Pad on the right, or by fewer than {width} "
                "columns."
            )

    def indexed_layer_type(self) -> str:
        return "minimax_m3_sparse"

    def tensor_parallel(self) -> str | None:
        return (
            "its block indexer hands one selection per KV head of the whole model (block_indices: B, H_kv, Tq, k), "
            "and a TP rank attends with a share of the heads"
        )

    def selected_blocks(self, module, kwargs: dict):
        blocks, indexer = kwargs.get("block_indices"), getattr(module, "indexer", None)
        if blocks is None or indexer is None:
            return None
        return blocks, indexer.block_size


HOOKS = BlockIndices()
