"""The cache: each rank's share of every layer's K/V (`ShardedCache`, transformers' `Cache` API),
the K/V block format the cache, the messages and the kernels share (`blocks`), and the
recurrent layers' states that pass down the ranks in prefill (`recurrent`)."""

from .sharded import ShardedCache, cache_argument, returned_cache

__all__ = ["ShardedCache", "cache_argument", "returned_cache"]
