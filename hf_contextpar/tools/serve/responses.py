"""What transformers' completions handler leaves out of a response, in OpenAI's form: the `logprobs` object."""

from __future__ import annotations


def logprobs(tokenizer, scores: dict, start: int) -> dict:
    """OpenAI's completions `logprobs` for the tokens from `start` on (0 with `echo`: the prompt's too; the first
    token of a prompt has no log-probability): each token's text, its log-probability, the top alternatives at its
    place as {text: log-probability}, and where its text starts in the response's text."""
    tokens = scores["tokens"][start:]
    texts = [tokenizer.decode([t]) for t in tokens]
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    tops = [None if top is None else {tokenizer.decode([t]): lp for t, lp in top} for top in scores["top"][start:]]
    return {
        "tokens": texts,
        "token_logprobs": scores["token_logprobs"][start:],
        "top_logprobs": tops,
        "text_offset": offsets,
    }
