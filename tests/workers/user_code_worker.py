"""One rank of the user-code matrix (issue 42): what users do around a patched model, each exact or refused
with a typed error on every rank. Dense (llama), MLA (deepseek_v3) and hybrid (qwen3_next, bamba) families:
a custom attention function registered with transformers (refused at apply), an attention forward patched to
call SDPA itself (refused at the forward, before any logits), a cache deep-copied / pickled / torch.saved and
continued (transformers' prompt-reuse recipe), training mode, model.forward(...) and the inner decoder, PEFT's
LoRA, and a dropped patched model's process group. Writes OUT/rank{r}.json (records.run_cases)."""

from __future__ import annotations

import copy
import gc
import io
import os
import pickle
import sys
import time
import warnings

import torch
import torch.distributed as dist
from cp_worker import gathered_equal  # noqa: E402
from hf_contextpar.eval.oracle import Fp64Internals  # noqa: E402
from hf_contextpar.patches import REGISTRY  # noqa: E402
from hybrids import FAMILIES as HYBRIDS  # noqa: E402
from hybrids import hybrid_model  # noqa: E402
from records import run_cases, tolerance  # noqa: E402
from user_patches import attention_modules, call_sdpa_itself

import hf_contextpar  # noqa: E402
from hf_contextpar.cache.sharded import returned_cache  # noqa: E402
from hf_contextpar.models import tiny_model  # noqa: E402

warnings.filterwarnings("ignore")
FAMILIES = ("llama", "deepseek_v3", "qwen3_next")  # dense, latent (MLA), hybrid
COPIED = (*FAMILIES, "bamba")  # the cache copies: a second hybrid (Mamba2 layers)


def model_of(family: str):
    """The family's fp64 tiny model (seeded: the same weights on every rank and every call)."""
    if family in HYBRIDS:
        return hybrid_model(family)
    return tiny_model(family, dtype=torch.float64, attn_implementation=REGISTRY[family].reference_attn)


def tol(family: str) -> float:
    return 1e-10 if family in HYBRIDS else tolerance(family, "float64")  # hybrids: under Fp64Internals


def ids_of(length: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, 250, (batch, length), generator=torch.Generator().manual_seed(seed))


def refused(fn, kind) -> dict:
    """Run fn, expecting a `kind` refusal: its type and message, and whether every rank got the same."""
    try:
        fn()
    except hf_contextpar.ContextParallelError as e:
        return dict(type=type(e).__name__, ok=isinstance(e, kind), message=str(e))
    return dict(type=None, ok=False, message="no error")


def same_everywhere(text: str) -> bool:
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, text)
    return all(g == got[0] for g in got)


# -- 1: attention that is not the library's -----------------------------------------------------------
def custom_attention(family):
    """A function registered with AttentionInterface (log-n query scaling) and 'sdpa' re-registered with a
    function of the user's: both refused at apply, naming the implementation."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def logn(module, query, key, value, attention_mask, scaling=None, **kw):
        scale = torch.log(torch.tensor(float(key.shape[-2] + 1), dtype=query.dtype)).clamp(min=1.0)
        return sdpa_attention_forward(module, query * scale, key, value, attention_mask, scaling=scaling, **kw)

    AttentionInterface.register("logn_scaled", logn)
    model = model_of(family)
    model.set_attn_implementation("logn_scaled")
    named = refused(lambda: hf_contextpar.apply_context_parallel(model), hf_contextpar.UnsupportedModelError)
    AttentionInterface.register("sdpa", logn)
    try:
        model = model_of(family)
        over = refused(lambda: hf_contextpar.apply_context_parallel(model), hf_contextpar.UnsupportedModelError)
    finally:
        AttentionInterface.register("sdpa", sdpa_attention_forward)
    unpatched = hf_contextpar.get_runtime(model) is None
    ok = named["ok"] and "'logn_scaled'" in named["message"] and over["ok"] and "'sdpa'" in over["message"]
    return dict(ok=ok and unpatched and same_everywhere(named["message"]), named=named, over=over)


def bypass(family):
    """The last attention layer's forward patched to call SDPA itself (as KV-compression patches do): the
    forward and generate() refused on every rank, naming the layer; unpatched again, the model is exact."""
    ref, model = model_of(family), model_of(family)
    layer = call_sdpa_itself(model)  # the layer's own code, with ALL_ATTENTION_FUNCTIONS' SDPA called directly
    hf_contextpar.apply_context_parallel(model, timeout=60)
    ids = ids_of(6 * dist.get_world_size() + 3)
    with torch.no_grad(), Fp64Internals():
        one = refused(lambda: model(ids), hf_contextpar.UnsupportedModelError)
        gen = refused(
            lambda: model.generate(ids, max_new_tokens=3, do_sample=False), hf_contextpar.UnsupportedModelError
        )
        batch = torch.cat([ids, ids.flip(1)])  # left padding: transformers' SDPA fails on the 2D mask's shard
        mask = torch.ones_like(batch)
        mask[1, :3] = 0
        padded = refused(lambda: model(batch, attention_mask=mask), hf_contextpar.UnsupportedModelError)
        del layer.forward  # the patch undone: exact again
        diff = float((model(ids).logits - ref(ids).logits).abs().max())
    names = all(f"layer {layer.layer_idx}" in r["message"] for r in (one, gen, padded))
    ok = one["ok"] and gen["ok"] and padded["ok"] and names and diff <= tol(family) and same_everywhere(one["message"])
    return dict(ok=ok, forward=one, generate=gen, padded=padded, diff_after=diff)


def library_error(family):
    """A bug inside the library's own code, raised from inside an attention layer's forward before it reaches the
    library's attention (the cache's update): it reaches the user as itself, never relabelled as the user's
    layer bypassing the library (a crash in the indexer exchange once read so); restored, the model is exact."""
    from hf_contextpar.cache.layers import ShardedLayer

    ref, model = model_of(family), model_of(family)
    hf_contextpar.apply_context_parallel(model, timeout=60)
    ns = {"__name__": "hf_contextpar.cache.layers"}  # the toy bug's frame is the library's, as a real one's is
    exec("def update(self, *args, **kwargs):\n    raise TypeError('a bug inside the library')", ns)
    original, ShardedLayer.update = ShardedLayer.update, ns["update"]
    ids = ids_of(6 * dist.get_world_size() + 3)
    try:
        with torch.no_grad(), Fp64Internals():
            model(ids)
        got = dict(type=None, message="no error")
    except Exception as e:
        got = dict(type=type(e).__name__, message=str(e))
    finally:
        ShardedLayer.update = original
    with torch.no_grad(), Fp64Internals():
        diff = float((model(ids).logits - ref(ids).logits).abs().max())
    ok = got["type"] == "TypeError" and "a bug inside the library" in got["message"]
    return dict(ok=ok and diff <= tol(family) and same_everywhere(got["message"]), error=got, diff_after=diff)


def bypass_direct():
    """An attention forward rewritten to call torch's SDPA itself (no transformers function on the way), on a
    padded batch: its shard meets the whole sequence's mask and torch fails; refused naming the layer."""
    model = model_of("llama")
    layer = attention_modules(model)[-1]

    def direct_sdpa(hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        b, t, _ = hidden_states.shape
        q, k, v = (
            p(hidden_states).view(b, t, -1, layer.head_dim).transpose(1, 2)
            for p in (layer.q_proj, layer.k_proj, layer.v_proj)
        )
        mask = attention_mask[:, None, None, :].bool() if attention_mask is not None else None
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return layer.o_proj(out.transpose(1, 2).reshape(b, t, -1)), None

    layer.forward = direct_sdpa
    hf_contextpar.apply_context_parallel(model, timeout=60)
    ids = ids_of(6 * dist.get_world_size() + 3)
    batch, mask = torch.cat([ids, ids.flip(1)]), torch.ones(2, ids.shape[1], dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        padded = refused(lambda: model(batch, attention_mask=mask), hf_contextpar.UnsupportedModelError)
    named = f"layer {layer.layer_idx}" in padded["message"] and "before reaching it" in padded["message"]
    return dict(ok=padded["ok"] and named and same_everywhere(padded["message"]), padded=padded)


# -- 3: caches that copy --------------------------------------------------------------------------------
def cache_copy(family):
    """Prefill a document once, then per question a deep copy (and a pickle and a torch.save round trip) of
    the cache continued by generate(): the reference's tokens, every copy's logits within the tolerance, the
    original cache untouched (the second question sees the document alone)."""
    ref, model = model_of(family), model_of(family)
    hf_contextpar.apply_context_parallel(model, timeout=60)
    n = dist.get_world_size()
    doc, questions = ids_of(6 * n + 5, 1), [ids_of(2 * n + 1, 2), ids_of(n + 2, 3)]
    out = dict(ok=True, diffs=[], tokens=[])
    with torch.no_grad(), Fp64Internals():
        caches = [returned_cache(m(doc, use_cache=True)) for m in (ref, model)]
        for q in questions:
            full = torch.cat([doc, q], 1)
            gens = [
                m.generate(full, past_key_values=copy.deepcopy(c), max_new_tokens=3, do_sample=False)
                for m, c in zip((ref, model), caches)
            ]
            buf = io.BytesIO()
            torch.save(caches[1], buf)
            buf.seek(0)
            copies = [
                copy.deepcopy(caches[1]),
                pickle.loads(pickle.dumps(caches[1])),
                torch.load(buf, weights_only=False),
            ]
            mask = torch.ones_like(full)
            want = ref(q, past_key_values=copy.deepcopy(caches[0]), attention_mask=mask).logits
            got = [model(q, past_key_values=c, attention_mask=mask).logits for c in copies]
            diffs = [float((g - want).abs().max()) for g in got]
            out["diffs"].append(diffs)
            out["tokens"].append(bool(torch.equal(gens[0], gens[1])))
            out["ok"] &= max(diffs) <= tol(family) and torch.equal(gens[0], gens[1]) and gathered_equal(got[0])
            out["ok"] &= all(torch.equal(g, got[0]) for g in got)  # every kind of copy: the same bytes
    return out


# -- 4, 5: training mode, model.forward, the inner decoder, PEFT --------------------------------------
def training(family):
    """model.train() with gradients on: refused at the forward, saying inference only and what to do; labels=
    refused without sending the user into a loss without gradients; eval() under no_grad: exact."""
    ref, model = model_of(family), model_of(family)
    hf_contextpar.apply_context_parallel(model, timeout=60)
    ids = ids_of(5 * dist.get_world_size())
    model.train()
    train = refused(lambda: model(ids), hf_contextpar.UnsupportedInputError)
    model.eval()
    labels = refused(lambda: model(ids, labels=ids), hf_contextpar.UnsupportedInputError)
    with torch.no_grad():
        diff = float((model(ids).logits - ref(ids).logits).abs().max())
    ok = train["ok"] and "inference only" in train["message"] and "torch.no_grad()" in train["message"]
    ok &= labels["ok"] and "no_grad" in labels["message"] and diff <= tol(family)
    return dict(ok=ok and same_everywhere(train["message"]), train=train, labels=labels, diff=diff)


def forward_and_inner(family):
    """model.forward(...) runs as model(...) does: the reference's logits within the tolerance (not bitwise one
    another's on a hybrid: balanced partitions move with the measured work); the inner decoder called by itself is
    refused, saying what to call instead."""
    ref, model = model_of(family), model_of(family)
    hf_contextpar.apply_context_parallel(model, timeout=60)
    ids = ids_of(5 * dist.get_world_size() + 1)
    with torch.no_grad(), Fp64Internals():
        direct, called, want = model.forward(ids).logits, model(ids).logits, ref(ids).logits
        inner = refused(lambda: model.get_decoder()(ids), hf_contextpar.PatchStateError)
    diff = max(float((direct - want).abs().max()), float((called - want).abs().max()))
    ok = diff <= tol(family) and gathered_equal(direct) and inner["ok"]
    ok &= "output_hidden_states=True" in inner["message"]
    return dict(ok=ok, diff=diff, inner=inner)


def peft_lora(family):
    """PEFT's LoRA (random adapters) on the patched model, both orders (get_peft_model on the patched model;
    apply to a PeftModel's base model), against the unpatched PeftModel: logits and greedy tokens; applying to
    the PeftModel itself is refused, saying which module to apply to."""
    from peft import LoraConfig, get_peft_model

    def lora(model):
        torch.manual_seed(1)
        config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, lora_dropout=0.0)
        return get_peft_model(model, config).eval()

    ref = lora(model_of(family))
    after = lora(hf_contextpar.apply_context_parallel(model_of(family), timeout=60))
    before = lora(model_of(family))
    wrapper = refused(lambda: hf_contextpar.apply_context_parallel(before), hf_contextpar.UnsupportedModelError)
    hf_contextpar.apply_context_parallel(before.get_base_model(), timeout=60)
    ids = ids_of(5 * dist.get_world_size() + 2)
    out = dict(ok=wrapper["ok"] and "get_base_model()" in wrapper["message"], wrapper=wrapper, diffs=[])
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        tokens = ref.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
        for peft_model in (after, before):
            diff = float((peft_model(input_ids=ids).logits - want).abs().max())
            same = torch.equal(peft_model.generate(input_ids=ids, max_new_tokens=4, do_sample=False), tokens)
            out["diffs"].append(diff)
            out["ok"] &= diff <= tol(family) and same
    return out


# -- 6: a dropped patched model -------------------------------------------------------------------------
def dropped_models(family):
    """Patched models with a group of their own (timeout=) dropped without remove_context_parallel: their
    groups and file descriptors go with them."""

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    counts, groups = [], []
    for _ in range(3):
        model = hf_contextpar.apply_context_parallel(model_of(family), timeout=60)
        with torch.no_grad():
            model(ids_of(3 * dist.get_world_size()))
        del model
        gc.collect()
        counts.append(fds())
        groups.append(len(dist.distributed_c10d._world.pg_map))
    return dict(ok=counts[-1] <= counts[0] and groups[-1] <= groups[0], fds=counts, groups=groups)


def cases(n):
    out = [(f"custom_attention-{f}", lambda f=f: custom_attention(f)) for f in FAMILIES]
    out += [(f"bypass-{f}", lambda f=f: bypass(f)) for f in FAMILIES]
    out += [("bypass_direct-llama", bypass_direct)]
    out += [(f"library_error-{f}", lambda f=f: library_error(f)) for f in ("llama", "qwen3_next")]
    out += [(f"cache_copy-{f}", lambda f=f: cache_copy(f)) for f in COPIED]
    out += [(f"forward_and_inner-{f}", lambda f=f: forward_and_inner(f)) for f in ("llama", "qwen3_next")]
    out += [("training-llama", lambda: training("llama")), ("peft_lora-llama", lambda: peft_lora("llama"))]
    out += [("dropped_models-llama", lambda: dropped_models("llama"))]
    return out


def selected(n):
    """argv[2], if given: the comma-separated cases to run (launch.selected's subset), else every case."""
    wanted = sys.argv[2].split(",") if len(sys.argv) > 2 else None
    return [(name, _timed(fn)) for name, fn in cases(n) if wanted is None or name in wanted]


def _timed(fn):
    def run():
        start = time.perf_counter()
        return dict(fn(), seconds=round(time.perf_counter() - start, 2))

    return run


if __name__ == "__main__":
    run_cases(selected)
