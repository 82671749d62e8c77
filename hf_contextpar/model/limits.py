"""What a patched model cannot combine, refused at apply: the settings against the model's layout (TP, DCP, its
recurrent layers); and before generate(), candidate decoding where it is not exact. Each refusal says what to use
instead. The model's own layer kinds are the contract's
(contract.py), DSA's the indexer's (attention/indexed.py)."""

from __future__ import annotations

from ..errors import CandidateDecodingError, HeadsNotDivisibleError, UnsupportedModelError
from ..mesh import heads_per_rank
from .contract import check_ulysses


def check_layout(model, settings, world: int, shape, tp: int, dcp, chain: bool):
    """dcp: (group, index, size) of the TP ranks sharing this rank's KV head, or None; chain: recurrent layers."""
    if dcp is not None and settings.whole_heads:
        raise HeadsNotDivisibleError(
            f"strategy='ulysses' splits the KV heads over the context-parallel ranks, and each rank holds one KV "
            f"head here, shared with {dcp[2] - 1} other TP rank(s) by sequence (DCP): use another strategy."
        )
    if settings.whole_heads:  # the heads this rank's attention receives, not the config's (dbrx, TP)
        check_ulysses(model.config, world, (shape.heads, shape.kv_heads) if tp > 1 else heads_per_rank(model))
    if chain and (settings.decode == "ring_pass_q" or dcp is not None):
        what = "decode='ring_pass_q' (it moves sequences between ranks)" if dcp is None else "DCP (--tp over KV heads)"
        raise UnsupportedModelError(
            f"{what} is not supported on a model with recurrent layers: their states are whole on every rank "
            "and pass down the ranks in prefill. Use decode='auto' or 'replicated', and TP up to the KV heads."
        )
    if settings.sparse is not None and dcp is not None:
        raise UnsupportedModelError(
            "sparse=CSA(...) is not supported with DCP (TP beyond the KV heads): use TP up to the KV heads."
        )


_CANDIDATE_ARGS = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")


def refuse_candidate_decoding(model, args, kwargs, indexed: bool = False):
    """Assisted and prompt-lookup decoding from inputs_embeds: transformers drafts from the empty input_ids and
    crops the mask to them (one process returns other tokens than greedy, or fails inside torch; with input_ids
    prompt lookup under a padding mask and a caller's cache fed a mask that does not match it: fuzz seed 900766
    case 234, N = 2). On indexed attention (DSA) both: the fuzz found their verification forwards off one process
    (deepseek_v32, glm_moe_dsa, axk2, dots3_note_text: seed 21 case 6 on N = 3, logits 0.08 to 1.9)."""
    config = kwargs.get("generation_config") or (args[1] if len(args) > 1 else None) or model.generation_config
    asked = [name for name in _CANDIDATE_ARGS if kwargs.get(name) is not None or getattr(config, name, None)]
    embeds = kwargs.get("inputs_embeds") is not None
    if asked and (indexed or embeds):
        where, why, instead = (
            (
                "on a model with indexed attention (DSA)",
                " under context parallelism: their verification forwards do not yet give one process's result",
                "",
            )
            if indexed
            else (
                "from inputs_embeds",
                " (transformers drafts from input_ids and crops the attention mask to them "
                "there: one process returns other tokens than greedy decoding, or fails inside torch)",
                "Pass input_ids instead of inputs_embeds, or ",
            )
        )
        raise CandidateDecodingError(
            f"generate({'inputs_embeds=..., ' * embeds}{asked[0]}=...): assisted and prompt-lookup decoding {where} "
            f"are not supported{why}. {instead} without an assistant or prompt lookup."
        )
