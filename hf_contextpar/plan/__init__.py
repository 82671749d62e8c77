"""The plan: what one forward does, decided before it runs, the same on every rank.

`forward` (the ForwardPlan: which tokens, columns and K/V each rank runs, stores and gathers),
`sharding` (which global columns each rank holds), `layout` (a cache's committed shard layout),
`partitions` (contiguous partitions of the chain and KV-Runahead), `costmodel` (predicted times,
pure) and `choice` (the strategy `auto` picks from it)."""
