"""DeepSeek-V4's compressed attention, simulated on one process: the design docs/design.md gives for running it
under context parallelism ("DeepSeek-V4's compressed attention"), checked before it is built.

Each simulated rank runs a contiguous span of the prompt through the model's own layers, continuing from what the
rank before it left in V4's cache layers (the sliding window's last window - 1 tokens, and per compressor the
unfinished group's rows `buffer_kv` / `buffer_gate`, CSA's `overlap_kv` / `overlap_gate` and `entry_count`: the state
chain), and its compressors' `update_compressor_states` hands back every rank's entries of the layer in global
order (the all-gather), not only the entries up to its own span. Against the one forward of the whole prompt:

    python -m dev.v4_chain_check                 # fp64, the model's fp32 internals in fp64 (Fp64Internals)
    python -m dev.v4_chain_check --as-shipped    # fp64 with its fp32 internals: what a plain chunked prefill moves

It prints, per partition, the max |logit diff| of (a) the spans chained with the gathered entries, (b) the spans
chained with only the entries the chunks made so far (a plain chunked prefill through V4's own cache), and (c) a
replicated decode step after the prompt, against one process's step over its own cache. (a) must be fp64-exact (except the\n1-token span, which HCA runs as decode: the plan must give each rank at least 2 tokens); (b) shows why the gather is needed: the CSA
indexer's top-k over a shorter row resolves ties (ReLU's zeros) otherwise.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from hf_contextpar.eval.oracle import Fp64Internals
from transformers import AutoModelForCausalLM, DynamicCache

from dev.census.configs import tiny_config

S, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
# the census's tiny config (its window, HCA every 8 tokens, CSA's top-k 4: every mechanism bites on 61 tokens) with a
# sliding-only layer too; position_bias and the sinks are zero at init, so they are drawn
TINY = dict(
    layer_types=[HCA, CSA, S],
    num_hidden_layers=3,
    mlp_layer_types=["hash_moe", "moe", "moe"],
)


def tiny_v4(dtype=torch.float64):
    torch.manual_seed(0)
    config = tiny_config("deepseek_v4")
    for k, v in TINY.items():
        setattr(config, k, v)
    model = AutoModelForCausalLM.from_config(
        config, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "position_bias" in name or name.endswith("sinks"):
                p.normal_(0, 1)
    return model.eval()


class Gathered:
    """Hands every compressor the whole layer's entries (what the all-gather gives a rank), after checking that the
    entries its own span made are the one forward's at the same indices."""

    def __init__(self, entries: dict):
        self.entries, self.worst = entries, 0.0

    def install(self, cache):
        for idx, layer in enumerate(cache.layers):
            if hasattr(layer, "update_compressor_states"):
                layer.update_compressor_states = self._wrap(idx, layer, layer.update_compressor_states)

    def _wrap(self, idx, layer, update):
        def update_compressor_states(name, compressed):
            before = layer.entry_count[name]
            own = update(name, compressed)  # the cache layer's own books: entry_count, the running list
            whole = self.entries[idx, name]
            if compressed.shape[1]:
                made = whole[:, before : before + compressed.shape[1]]
                self.worst = max(self.worst, (made - compressed).abs().max().item())
            return whole if own is not None else own

        return update_compressor_states


def position_ids(ids, mask):
    """What generate() passes: global positions, a padded row's counted from its first real token (pads at 1)."""
    if mask is None:
        return torch.arange(ids.shape[1])[None].expand(len(ids), -1)
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)


def record_entries(model, ids, mask):
    """The one forward's compressed entries per (layer, compressor name), from V4's cache after it."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, position_ids=position_ids(ids, mask), cache=cache).logits
    entries = {}
    for idx, layer in enumerate(cache.layers):
        for name, t in getattr(layer, "compressed_kv", {}).items():
            entries[idx, name] = t
    return logits, entries


def chained(model, ids, mask, cuts, entries=None):
    """The prompt in contiguous spans, each continuing from the cache the span before left (the state chain);
    `entries`: the gathered ones, else only those made so far. Returns (logits, worst entry diff, cache)."""
    cache = DynamicCache(config=model.config)
    gathered = Gathered(entries) if entries is not None else None
    outs, prev, total = [], 0, ids.shape[1]
    positions = position_ids(ids, mask)
    with torch.no_grad():
        for cut in [*cuts, total]:
            pos = positions[:, prev:cut]
            kw = dict(attention_mask=mask[:, :cut]) if mask is not None else {}
            if gathered is not None and not getattr(cache, "_gathered", False) and cache.layers:
                gathered.install(cache)
                cache._gathered = True
            outs.append(model(ids[:, prev:cut], cache=cache, position_ids=pos, use_cache=True, **kw).logits)
            prev = cut
    return torch.cat(outs, 1), (gathered.worst if gathered is not None else 0.0), cache


PARTITIONS = {  # the cuts between simulated ranks' spans of the 61-token prompt
    "N=2": [31],
    "N=3": [21, 41],
    "N=4": [16, 31, 46],
    "N=4, spans shorter than a group": [2, 4, 6],
    "N=4, cuts inside CSA and HCA groups": [9, 26, 43],
    # HCA drops its block_bias for a 1-token forward (decode): over the gathered entries that span sees later
    # ones. Expected to differ: the plan must give every chained rank at least 2 tokens (it does for hybrids)
    "N=4, a 1-token span (expected to differ)": [3, 5, 6],
}


def prompt():
    """(ids, mask, next token): two rows of 61 tokens, the second left-padded by 7, and a decode step's token."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (2, 61), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    return ids, mask, torch.randint(3, 256, (2, 1), generator=g)


def check(model, cuts, padded: bool, plain: bool = True) -> dict:
    """Max |logit diff| against one process: the spans chained with the gathered entries ("gathered"), their own
    entries against the one forward's ("entries"), a plain chunked prefill ("plain"), the decode step after the
    chained prefill against one process's step over its own cache ("decode"); `plain=False` skips the plain one.
    Run it under Fp64Internals for the fp64-exact claim."""
    ids, mask, nxt = prompt()
    m = mask if padded else None
    whole, entries = record_entries(model, ids, m)
    gathered, worst, cache = chained(model, ids, m, cuts, entries)
    unchained = chained(model, ids, m, cuts)[0] if plain else whole
    rows = m.bool() if m is not None else torch.ones_like(ids, dtype=torch.bool)
    full_ids = torch.cat([ids, nxt], 1)
    fm = torch.cat([m, torch.ones_like(nxt)], 1) if m is not None else None
    pos = position_ids(full_ids, fm)[:, -1:]
    kw = dict(attention_mask=fm) if fm is not None else {}
    with torch.no_grad():  # one process: the whole prompt, then the step over its cache (generate's)
        ref_cache = DynamicCache(config=model.config)
        model(ids, attention_mask=m, position_ids=position_ids(ids, m), cache=ref_cache)
        one = model(nxt, cache=ref_cache, position_ids=pos, **kw).logits[:, -1]
        step = model(nxt, cache=cache, position_ids=pos, **kw).logits[:, -1]
    return dict(
        gathered=(gathered - whole).abs().amax(-1)[rows].max().item(),
        entries=worst,
        plain=(unchained - whole).abs().amax(-1)[rows].max().item() if plain else None,
        decode=(step - one).abs().max().item(),
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--as-shipped", action="store_true", help="keep the model's fp32 internals (no Fp64Internals)")
    args = p.parse_args(argv)
    model = tiny_v4()
    with contextlib.nullcontext() if args.as_shipped else Fp64Internals():
        for padded in (False, True):
            for what, cuts in PARTITIONS.items():
                d = check(model, cuts, padded)
                print(
                    f"{'padded' if padded else 'plain '} {what:41s} chained+gathered {d['gathered']:.1e} (own entries "
                    f"vs the one forward's {d['entries']:.1e}); plain chunked prefill {d['plain']:.1e}; decode step "
                    f"after it {d['decode']:.1e}"
                )


if __name__ == "__main__":
    main()
