"""MiniMax-M3 (text): block-sparse attention whose lightning indexer hands its top key blocks as `block_indices`.

Its `minimax_m3_sparse` layers' indexer scores every earlier key slot against one head of index keys (kept on the
layer's cache layer by `update_index`, which the sharded cache answers with every column's, attention/indexed.py),
max-pools the scores over blocks of `index_block_size` slots counted from the cache's first slot, and passes each
query's top `index_topk_blocks` blocks per KV head to its attention as `block_indices` (B, H_kv, Tq, k), -1 for an
unused slot. A rank's indexer thus sees the whole row, so its blocks are one process's; slot = global column, so the
blocks are global columns in runs of `index_block_size`, which the engine expands (`indexed.block_selection`)."""

from __future__ import annotations

from hf_contextpar.model.families import FamilyHooks


class BlockIndices(FamilyHooks):
    def indexed_layer_type(self) -> str:
        return "minimax_m3_sparse"

    def selected_blocks(self, module, kwargs: dict):
        blocks, indexer = kwargs.get("block_indices"), getattr(module, "indexer", None)
        if blocks is None or indexer is None:
            return None
        return blocks, indexer.block_size


HOOKS = BlockIndices()
