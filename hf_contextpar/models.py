"""Built-in models: everything works offline.

`needle-lm` is a real, trained model shipped inside the package (a 1.7M-parameter Qwen2 with a
BPE tokenizer, trained by dev/train_needle_lm.py to retrieve facts from long documents): the
default for the main job, the eval harness, the benchmark and the examples, so that their scores
mean something. `tiny-<family>` names build a small random-initialised config of that family
(seeded, so every rank builds the same weights) with a byte-level tokenizer, for the family test
matrix. Any hub id or local directory works in their place.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from hf_contextpar.patches import REGISTRY

TINY_BASE = dict(  # what every tiny config shares; TINY_CONFIGS add the family's own
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=65536,
    initializer_range=0.2,
    tie_word_embeddings=False,
    bos_token_id=256,
    eos_token_id=257,
    pad_token_id=258,
)

# one tiny config per registered family (patches/), plus the benchmark's attention-dominated models
TINY_CONFIGS: dict[str, dict] = {
    **{mt: dict(model_type=mt, **p.tiny) for mt, p in REGISTRY.items() if p.tiny is not None},
    # benchmark model: attention-dominated, 8 query heads per KV head (Llama-3-70B's ratio)
    "llama_gqa8": dict(
        model_type="llama",
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=32,
    ),
    # benchmark hybrid (issue 30): Qwen3-Next's pattern, 3 Gated DeltaNet layers to 1 attention layer, dense MLPs
    "qwen3_next_hybrid": dict(
        model_type="qwen3_next",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=8,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_value_heads=8,
        linear_num_key_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        mlp_only_layers=list(range(8)),
    ),
    # the same with 2 KV heads (Llama-3-8B's ratio 4:1), so Ulysses can split heads over N=2
    "llama_gqa4": dict(
        model_type="llama",
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
    ),
}
DEFAULT_MODEL = "needle-lm"
# built-in trained models: name -> directory under hf_contextpar/assets (package data)
BUILTIN_MODELS = {"needle-lm": "needle-lm"}


def builtin_model_path(name: str) -> str | None:
    """The directory of a built-in trained model (a standard HF model directory), or None."""
    if name not in BUILTIN_MODELS:
        return None
    from importlib.resources import files

    return str(files("hf_contextpar") / "assets" / BUILTIN_MODELS[name])


def is_builtin(name: str) -> bool:
    """A model that ships with hf-contextpar (trained or tiny random): its data default to offline text."""
    return name in BUILTIN_MODELS or (name.startswith("tiny-") and name[5:] in TINY_CONFIGS)


def tiny_config(family: str, **overrides):
    spec = {**TINY_BASE, **TINY_CONFIGS[family], **overrides}
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def tiny_model(family: str, dtype=torch.float32, seed: int = 0, attn_implementation: str = "sdpa", **overrides):
    """A seeded random-initialised model of `family` (same weights on every rank)."""
    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    return model.eval()


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """UTF-8 bytes as tokens 0..255 plus <s>=256, </s>=257, <pad>=258."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_order = sorted(alphabet, key=lambda ch: _byte_of(ch))
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(byte_order)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    out.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"})
    return out


def _byte_of(ch: str) -> int:
    # GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to 256+k in byte order.
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    if ord(ch) in printable:
        return ord(ch)
    rest = [b for b in range(256) if b not in printable]
    return rest[ord(ch) - 256]


def sample_text(num_chars: int | None = None) -> str:
    """English text already on every Python install (pydoc's topic help), for offline prompts."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return text if num_chars is None else text[:num_chars]


def heldout_topic_keys() -> list[str]:
    """The pydoc topics kept out of the built-in model's training (every 4th, by sorted name).

    `needle-lm` (dev/train_needle_lm.py) never sees them, so teacher-forced perplexity on
    `heldout_text()` measures language modelling on unseen text.
    """
    from pydoc_data.topics import topics

    return [k for i, k in enumerate(sorted(topics)) if i % 4 == 1]


def heldout_text() -> str:
    """The held-out pydoc topics, joined like `sample_text`."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in heldout_topic_keys())


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
LOAD_DTYPES = ("auto", *sorted(DTYPES))  # what the model-loading commands take: "auto" is the checkpoint's own


def load_dtype(name: str) -> torch.dtype | str:
    """A `--dtype` value as transformers' from_pretrained takes it ("auto": the checkpoint's own dtype, as
    transformers 5 loads by default; a bf16 checkpoint read as float32 would take twice the memory planned)."""
    return "auto" if name == "auto" else DTYPES[name]


def max_positions(model) -> int | None:
    """The positions the model was built for (its text config's max_position_embeddings), if it says."""
    return getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)


def load(name: str, dtype: torch.dtype | str, device: torch.device):
    """(model, tokenizer), in `dtype` ("auto": the checkpoint's own, as transformers 5 loads it): a built-in model (`needle-lm`, or `tiny-<family>` with random weights and
    the family's reference attention), or any hub id / local directory. For the tools (CLI, eval,
    bench), so none of them imports another."""
    if name.startswith("tiny-") and name[5:] in TINY_CONFIGS:
        family = name[5:]
        impl = REGISTRY[family].reference_attn if family in REGISTRY else "sdpa"
        dtype = torch.float32 if dtype == "auto" else dtype  # random weights: no checkpoint dtype to keep
        return tiny_model(family, dtype=dtype, attn_implementation=impl).to(device), byte_tokenizer()
    from transformers import AutoTokenizer

    path = builtin_model_path(name) or name
    try:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except OSError as e:
        raise SystemExit(
            f"could not load '{name}' ({e}). Use a local directory, a hub id that is cached or reachable "
            f"(HF_HUB_OFFLINE=1 uses the cache only), or a built-in model: "
            + ", ".join(list(BUILTIN_MODELS) + [f"tiny-{f}" for f in TINY_CONFIGS])
        ) from None
    if not tok("The", add_special_tokens=False).input_ids:  # transformers builds an empty one from a config alone
        raise SystemExit(f"'{name}' has no usable tokenizer (it turns text into no tokens); add its tokenizer files.")
    return model.to(device).eval(), tok
