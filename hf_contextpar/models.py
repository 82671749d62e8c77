"""Built-in random-initialised models and a byte-level tokenizer: everything works offline.

`tiny-<family>` names build a small config of that family (seeded, so every rank builds the
same weights). They exist for the default demo and the test suite; any hub id or local
directory works in their place.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from hf_contextpar.patches import REGISTRY

_COMMON = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=65536, initializer_range=0.2, tie_word_embeddings=False,
               bos_token_id=256, eos_token_id=257, pad_token_id=258)

# one tiny config per registered family (patches/), plus the benchmark's attention-dominated models
TINY_CONFIGS: dict[str, dict] = {
    **{mt: dict(model_type=mt, **p.tiny) for mt, p in REGISTRY.items() if p.tiny is not None},
    # benchmark model: attention-dominated, 8 query heads per KV head (Llama-3-70B's ratio)
    "llama_gqa8": dict(model_type="llama", hidden_size=256, intermediate_size=512, num_attention_heads=8,
                       num_key_value_heads=1, head_dim=32),
    # the same with 2 KV heads (Llama-3-8B's ratio 4:1), so Ulysses can split heads over N=2
    "llama_gqa4": dict(model_type="llama", hidden_size=256, intermediate_size=512, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=32),
}
DEFAULT_MODEL = "tiny-llama"


def tiny_config(family: str, **overrides):
    spec = {**_COMMON, **TINY_CONFIGS[family], **overrides}
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
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    if ord(ch) in printable:
        return ord(ch)
    rest = [b for b in range(256) if b not in printable]
    return rest[ord(ch) - 256]


def sample_text(num_chars: int | None = None) -> str:
    """English text already on every Python install (pydoc's topic help), for offline prompts."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return text if num_chars is None else text[:num_chars]
