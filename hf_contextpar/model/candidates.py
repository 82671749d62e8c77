"""Candidate decoding (assisted, prompt lookup) where one process does not compute what it means to, refused before
generate() runs any collective, with what to use instead. The model's own layer kinds are refused by the contract
(contract.py); what a capability refuses, by its own room (hf_contextpar/capabilities.py lists them)."""

from __future__ import annotations

from transformers.cache_utils import Cache

from ..cache.sharded import cache_argument
from ..errors import CacheMismatchError, CandidateDecodingError

_CANDIDATE_ARGS = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")


def refuse_candidate_decoding(model, args, kwargs):
    """Assisted and prompt-lookup decoding where one process does not compute what it means to. From inputs_embeds:
    transformers drafts from the empty input_ids and crops the mask to them (one process returns other tokens than
    greedy, or fails inside torch; with input_ids prompt lookup under a padding mask and a caller's cache fed a mask
    that does not match it: fuzz seed 900766 case 234, N = 2). Over a cache that already holds tokens (a later turn):
    its first verification forward feeds the whole sequence again on top of the cache (transformers 5.24,
    `_assisted_decoding`: no slicing on the first iteration), so one process attends to the context twice. The
    forward refuses that where the mask shows it (model/contract.py); generate() passes no mask for an all-ones one,
    so it is refused here, before any collective. On indexed attention (DSA) that input cannot even be matched: a
    token's two copies get equal index scores where one process made their keys bit for bit alike, and the shards'
    own last bits (a prefill GEMM over fewer rows) break those ties otherwise (fuzz seed 21 case 6, N = 3)."""
    config = kwargs.get("generation_config") or (args[1] if len(args) > 1 else None) or model.generation_config
    asked = [name for name in _CANDIDATE_ARGS if kwargs.get(name) is not None or getattr(config, name, None)]
    if not asked:
        return
    if kwargs.get("inputs_embeds") is not None:
        raise CandidateDecodingError(
            f"generate(inputs_embeds=..., {asked[0]}=...): assisted and prompt-lookup decoding from inputs_embeds are "
            "not supported (transformers drafts from input_ids and crops the attention mask to them there: one "
            "process returns other tokens than greedy decoding, or fails inside torch). Pass input_ids instead of "
            "inputs_embeds, or decode without an assistant or prompt lookup."
        )
    name = "cache" if "cache" in kwargs and cache_argument(model) == "cache" else "past_key_values"
    cache = kwargs.get(name)
    held = cache.get_seq_length() if isinstance(cache, Cache) else 0
    if held:
        raise CacheMismatchError(
            f"generate({asked[0]}=..., {name}=<a cache holding {held} tokens>): transformers' assisted and "
            "prompt-lookup decoding feed the whole sequence again on top of a cache an earlier call filled (one "
            "process attends to the context twice there). Start them with no cache (or an empty one), or continue "
            "the conversation without an assistant or prompt lookup."
        )
