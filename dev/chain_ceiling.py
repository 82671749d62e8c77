"""How fast a chained prefill can be with contiguous partitions (issue #44: the hybrid bench's 1.9x bar).

A model with recurrent layers passes their states down the ranks: rank r runs a chained layer once it has finished
the layer before and rank r - 1 has got that layer's state out (`--state-at`: the share of rank r - 1's layer done
by then; 1: its end), or, with `--needed-at` (the share of its own layer it runs before it needs the state:
patches/gated_delta.py's late state), runs that share first and waits then; it runs an attending layer no earlier than rank r - 1 started it (KV-Runahead's K/V come down
the ranks). A layer costs a rank per_token / L a token plus, if it attends, per_pair / (attending layers) a key its
queries see: `balanced`'s two terms, split by `--token-share` (the share of a one-process prefill that the per-token
term holds). This prints the predicted speed-up over one process of even partitions, of the library's balanced ones
(equal work), and of the best contiguous partition a grid search (KVR-S's, on the prediction) finds:

    python -m dev.chain_ceiling --model tiny-qwen3_next_hybrid --length 16384 --world 2
"""

from __future__ import annotations

import argparse

from hf_contextpar.models import tiny_config
from hf_contextpar.plan.partitions import balanced, even, key_pairs, search


def finish(sizes, per_token: float, per_pair: float, layers, state_at: float = 1.0, needed_at: float = 0.0) -> float:
    """Predicted seconds until the last rank finishes (module docstring); layers: per layer (chained, attends)."""
    tok, pair = per_token / len(layers), per_pair / max(1, sum(a for _, a in layers))
    before, last, start = None, 0.0, 0  # before: rank r - 1's per-layer (start, seconds)
    for n in sizes:
        t, mine = 0.0, []
        work = [tok * n + (pair * key_pairs(start, start + n, 0) if attends else 0.0) for _, attends in layers]
        for i, (chained, attends) in enumerate(layers):
            if before is not None and chained:
                t = max(t + needed_at * work[i], before[i][0] + state_at * before[i][1]) - needed_at * work[i]
            elif before is not None and attends:
                t = max(t, before[i][0])
            mine.append((t, work[i]))  # a chained layer's: as if it started needed_at * work before its wait ended
            t += work[i]
        before, last, start = mine, max(last, t), start + n
    return last


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-qwen3_next_hybrid")
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--state-at", type=float, default=1.0)
    p.add_argument("--needed-at", type=float, default=0.0)
    p.add_argument("--token-share", type=float, nargs="+", default=[0.4, 0.6, 0.8])
    args = p.parse_args()
    types = tiny_config(args.model.removeprefix("tiny-")).layer_types
    layers = [(t == "linear_attention", t != "linear_attention") for t in types]
    T, one = args.length, 1.0  # one process's prefill: 1 second, split between the two terms
    print(f"{args.model}: {len(layers)} layers, {sum(c for c, _ in layers)} chained; T = {T}, N = {args.world}")
    for share in args.token_share:
        per_token, per_pair = share * one / T, (1 - share) * one / key_pairs(0, T, 0)

        def speedup(sizes):
            return one / finish(sizes, per_token, per_pair, layers, args.state_at, args.needed_at)

        best = search(T, args.world, lambda s: 1 / speedup(s) if min(s) >= 2 else float("inf"), min_stride=T // 2000)[0]
        parts = [("even", even(T, args.world)), ("balanced", balanced(T, args.world, 0, per_token, per_pair))]
        print(
            f"token share {share:.2f}: "
            + ", ".join(f"{name} {speedup(s):.2f}x" for name, s in parts)
            + f", best contiguous {speedup(best):.2f}x {best}"
        )


if __name__ == "__main__":
    main()
