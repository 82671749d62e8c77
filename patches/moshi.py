"""Moshi (text): full causal attention over sliding cache layers.

Moshi's decoder masks full causal while the cache its config makes (`DynamicCache(config=...)`) keeps sliding layers
of `config.sliding_window` tokens (the last window - 1), so one process attends to a forward's every token and to
what the cache kept. Its layers attend with no window of their own over what their cache layer holds; the plan drops
those layers' columns as the cache does, so the adapter needs only to accept that pairing (for any other family a
cache window its attention does not use is a cache made for another config)."""

from __future__ import annotations

from hf_contextpar.model.families import FamilyHooks


class FullOverSlidingCache(FamilyHooks):
    def attends_window(self, cache_window: int, attention_window) -> bool:
        return attention_window in (cache_window, None)


HOOKS = FullOverSlidingCache()
