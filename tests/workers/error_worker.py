"""One rank of error scenarios; prints 'SCENARIO <name>' and then its 'RESULT <text>' lines, which the test
reads. argv[1]: one scenario, or several comma-separated, run in turn in this one launch (each on a
model and process group of its own; those that leave the ranks at different collectives run alone)."""

from __future__ import annotations

import copy
import os
import sys
import time

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

import hf_contextpar
from hf_contextpar.models import tiny_model

# families a user might register by hand that hf-contextpar cannot serve exactly: each must be refused
# on every rank (at apply or at the first forward), never give another answer than one process
_SMALL = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, vocab_size=256)
REGISTERED = {
    # two attention calls per layer, each on half of V (differential attention; without patches/diffllama.py)
    "registered_diffllama": ("diffllama", dict(_SMALL, num_attention_heads=4, num_key_value_heads=2)),
    # K/V repeated to every head after the cache update: attention sees other tensors than the cache's (without
    # the library's patches/jetmoe.py, which the scenario drops: the structural guard catches the model as it is)
    "registered_jetmoe": (
        "jetmoe",
        dict(_SMALL, num_attention_heads=4, num_key_value_heads=2, kv_channels=8, num_local_experts=2),
    ),
    # a learned score bias handed to the attention as its mask: caught by the structural guard alone, without the
    # library's patches/doge.py (which hands it as a score bias from each block's values)
    "registered_doge": (
        "doge",
        dict(_SMALL, num_attention_heads=4, num_key_value_heads=2, keep_window_size=8),
    ),
    # attention not written against transformers' AttentionInterface: the switch does not take
    "registered_gpt_neo": (
        "gpt_neo",
        dict(num_layers=2, hidden_size=32, num_heads=2, vocab_size=256, attention_types=[[["global", "local"], 1]]),
    ),
}


DSA_REFUSED = {"dsa_pass_q": dict(strategy="ring_pass_q"), "dsa_decode_pass_q": dict(decode="ring_pass_q")}


def registered(scenario):
    """A tiny model of a family registered by hand, as a user would opt in."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_contextpar import patches
    from hf_contextpar.model import families

    model_type, config = REGISTERED[scenario]
    families.INEXACT.pop(model_type, None)  # what a user cannot do: here it shows the guard needs no list
    families.BUILTIN.discard(model_type)  # nor this: a listed family's entry (its patch) replaced by a bare one
    patches.register(patches.FamilyPatch(model_type, "registered by hand"))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config)).eval()


def main():
    scenarios = sys.argv[1].split(",")
    if len(scenarios) == 1:
        print(f"SCENARIO {scenarios[0]}", flush=True)
        return run(scenarios[0], batched=False)
    for scenario in scenarios:
        print(f"SCENARIO {scenario}", flush=True)
        try:
            run(scenario, batched=True)
        except Exception as e:  # not a refusal: this scenario's test fails, the others still run
            print(f"RESULT {type(e).__name__} {e}", flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run(scenario: str, batched: bool):
    rank = int(os.environ["RANK"])
    timeout = float(os.environ.get("CP_TIMEOUT", "60"))
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    from hf_contextpar.model import families

    saved = dict(families.REGISTRY), set(families.BUILTIN), dict(families.INEXACT)  # the next scenario's back
    try:
        if scenario in REGISTERED:
            model = hf_contextpar.apply_context_parallel(registered(scenario), timeout=timeout)
            with torch.no_grad():
                model.generate(ids, max_new_tokens=4)
            print("RESULT no error", flush=True)
            return
    except hf_contextpar.ContextParallelError as e:
        print(f"RESULT {type(e).__name__} {e}", flush=True)
        return
    finally:
        for table, kept in zip((families.REGISTRY, families.BUILTIN, families.INEXACT), saved):
            table.clear()
            table.update(kept)
        if scenario in REGISTERED and dist.is_initialized() and not batched:
            dist.destroy_process_group()
    if scenario == "diffllama_ulysses":  # its expansion of the cached V mixes KV heads (patches/diffllama.py)
        torch.manual_seed(0)
        config = AutoConfig.for_model("diffllama", **REGISTERED["registered_diffllama"][1])
        try:
            model = hf_contextpar.apply_context_parallel(
                AutoModelForCausalLM.from_config(config).eval(), timeout=timeout, strategy="ulysses"
            )
            with torch.no_grad():
                model.generate(ids, max_new_tokens=4)
            print("RESULT no error", flush=True)
        except hf_contextpar.ContextParallelError as e:
            print(f"RESULT {type(e).__name__} {e}", flush=True)
        return
    if scenario in DSA_REFUSED:  # indexed attention: what would move a query away from its indexer's selection
        try:
            hf_contextpar.apply_context_parallel(tiny_model("deepseek_v32"), timeout=timeout, **DSA_REFUSED[scenario])
            print("RESULT no error", flush=True)
        except hf_contextpar.ContextParallelError as e:
            print(f"RESULT {type(e).__name__} {e}", flush=True)
        return
    check = not scenario.endswith("_unchecked")  # the refusals that hold without the input check too
    model = hf_contextpar.apply_context_parallel(tiny_model("llama"), timeout=timeout, check_inputs=check)
    try:
        with torch.no_grad():
            if scenario == "mismatch":
                model.generate(ids + rank, max_new_tokens=4)
            elif scenario == "mismatch_decode":  # same prompt, unseeded sampling: decode inputs differ
                torch.manual_seed(rank)
                model.generate(ids, max_new_tokens=8, do_sample=True, top_k=0)
            elif scenario in ("dies", "stalls"):  # rank 1 exits, or hangs without exiting
                if rank == 1:
                    if scenario == "dies":
                        os._exit(3)
                    time.sleep(16)  # well past the others' 8 s timeout
                    os._exit(4)
                start = time.time()
                try:
                    model.generate(ids, max_new_tokens=4)
                finally:
                    print(f"RESULT elapsed {time.time() - start:.1f}", flush=True)
            elif scenario == "mask4d":
                model(ids, attention_mask=torch.ones(1, 1, 40, 40))
            elif scenario == "labels":
                model(ids, labels=ids)
            elif scenario in ("batch_grows", "batch_shrinks"):  # a cache of another batch size
                # one process fails in torch; here the decode token (batch_grows) once crashed on the
                # rank storing it while the others waited, and 3 new tokens for 1 of 2 cached
                # sequences ran silently, writing that sequence's K/V into both
                b0, b1, t = (1, 2, 1) if scenario == "batch_grows" else (2, 1, 3)
                cache = model(ids.expand(b0, -1)).past_key_values
                model(ids[:, :t].expand(b1, -1), past_key_values=cache)
            elif scenario == "after_remove":  # the sharded cache once served 1/N of the keys to the stock model
                out = model.generate(ids, max_new_tokens=3, return_dict_in_generate=True)
                hf_contextpar.remove_context_parallel(model)
                model.generate(out.sequences, past_key_values=out.past_key_values, max_new_tokens=3)
            elif scenario == "attn_changed":  # each rank would attend to its own shard alone
                model.set_attn_implementation("sdpa")
                model(ids)
            elif scenario == "keep_differs":  # different gathers after the forward: caught by the input check
                model(ids, logits_to_keep=1 + rank)
            elif scenario == "max_new_differs":  # over gloo: a rank done meets one decoding (was a SIGABRT)
                hf_contextpar.get_runtime(model).comm.close_shm()
                model.generate(ids, max_new_tokens=3 + 2 * rank)
            elif scenario == "dropout":
                for m in model.modules():
                    if hasattr(m, "attention_dropout"):
                        m.attention_dropout = 0.5
                model.train()
                model(ids)
            elif scenario == "deepcopy":
                copy.deepcopy(model)
            elif scenario == "partitions_differ":  # how partitions are cut decides the chain's messages
                hf_contextpar.apply_context_parallel(tiny_model("llama"), partitions="even" if rank else "balanced")
            elif scenario == "timeout_differs":  # decides whether a group is made: once on one rank only
                hf_contextpar.apply_context_parallel(tiny_model("llama"), timeout=15.0 if rank == 0 else None)
            elif scenario.startswith(
                "lookup_from_embeds"
            ):  # one process drafts from no tokens and returns other tokens
                emb = model.get_input_embeddings()(ids)
                model.generate(inputs_embeds=emb, prompt_lookup_num_tokens=3, max_new_tokens=4, do_sample=False)
            elif scenario == "zero_tokens":  # one process fails inside the model (a reshape of 0 elements)
                model(ids[:, :0])
            elif scenario == "negative_keep":  # Gemma 4 slices by it twice: refused for every model
                model(ids, logits_to_keep=-2)
            elif scenario == "foreign_cache":
                cache = DynamicCache()
                cache.update(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16), 0)
                model(ids, past_key_values=cache)
        print("RESULT no error", flush=True)
    except hf_contextpar.ContextParallelError as e:
        print(f"RESULT {type(e).__name__} {e}", flush=True)
    if dist.is_initialized() and scenario not in ("dies", "stalls") and not batched:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
