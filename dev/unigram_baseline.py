"""Perplexity of unigram models on the held-out text, the baseline for needle-lm's BookCorpus-style score.

    python dev/unigram_baseline.py [--model needle-lm] [--window 8192 --num-windows 4]

Two baselines over the same tokens the eval harness scores (`--source builtin`: the held-out pydoc
topics, `hf_contextpar.tools.models.heldout_text()`, cut into windows as `eval bookcorpus` does):
the training text's unigram distribution (add-one smoothed), and the held-out text's own
unigram distribution (an oracle no causal model is given). Compare with the perplexity that
`python -m hf_contextpar.eval bookcorpus` reports.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="needle-lm")
    p.add_argument("--window", type=int, default=8192)
    p.add_argument("--num-windows", type=int, default=4)
    args = p.parse_args()
    from train_needle_lm import training_documents
    from transformers import AutoTokenizer

    from hf_contextpar.models import builtin_model_path, heldout_text

    tok = AutoTokenizer.from_pretrained(builtin_model_path(args.model) or args.model)
    ids = tok(heldout_text(), add_special_tokens=False).input_ids[: args.window * args.num_windows]
    train = Counter()
    for doc in training_documents():
        train.update(tok(doc, add_special_tokens=False).input_ids)
    total, vocab = sum(train.values()), len(tok)
    nll = -sum(math.log((train[t] + 1) / (total + vocab)) for t in ids) / len(ids)
    own = Counter(ids)
    oracle = -sum(c * math.log(c / len(ids)) for c in own.values()) / len(ids)
    print(
        f"{len(ids)} held-out tokens: training-text unigram perplexity {math.exp(nll):.1f}, "
        f"held-out oracle unigram perplexity {math.exp(oracle):.1f}"
    )


if __name__ == "__main__":
    main()
