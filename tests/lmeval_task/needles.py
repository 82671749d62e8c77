"""A local lm-eval task for tests/*/test_lmeval.py (no hub): NeedleBench-style questions about a fact
hidden in held-out English text (the built-in needles; text needle-lm never saw in training), asked
three ways: by loglikelihood over four answers (cp_needle_mc), by greedy generation (cp_needle_gen),
and rolling loglikelihood over four documents (cp_rolling). Built here, deterministically, from
data that ships with hf-contextpar; lm-eval calls these through the YAML files' `custom_dataset`."""

import datasets
from hf_contextpar.eval.needles import NEEDLES

from hf_contextpar.models import heldout_text

ITEMS = 20


def _prompt(document: str, question: str) -> str:  # the form needle-lm was trained on (examples/generate.py)
    return (
        "You are an intelligent AI assistant skilled in answering user questions.\n"
        "Please keep your answers concise and clear. Do not talk about irrelevant topics or repeat your answers.\n"
        f"The document given to you by the user is {document}\n\nNow, the question is: {question}\n"
    )


def _needle_items():
    text = heldout_text()
    items = []
    for i in range(ITEMS):
        n = NEEDLES[i % len(NEEDLES)]
        start, length = 1500 * i, 600 + 90 * i  # 600 to 2,310 characters of haystack
        hay = text[start : start + length]
        at = hay.rfind(" ", 0, length * (i % 5) // 4 + 1) + 1  # depth 0, 25, 50, 75, 100%
        document = hay[:at] + "\n" + n["needle"] + "\n" + hay[at:]
        answer_prefix = n["retrieval_question"].split("'")[-2].split("______")[0].rstrip()  # "The number is"
        others = [NEEDLES[(i + k) % len(NEEDLES)]["arg2"] for k in (1, 2, 3)]
        target = i % 4
        choices = others[:target] + [n["arg2"]] + others[target:]
        items.append(
            dict(
                prompt=_prompt(document, n["retrieval_question"]),
                answer_prefix=answer_prefix,
                keyword=n["arg2"],
                choices=choices,
                target=target,
            )
        )
    return items


def needle_docs(**_metadata):
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(_needle_items())})


def rolling_docs(**_metadata):
    text = heldout_text()
    docs = [text[40_000 + 3_000 * k : 40_000 + 3_000 * k + 1_500 + 500 * k] for k in range(4)]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list([dict(text=d) for d in docs])})


def keyword_found(doc, results):
    """NeedleBench's keyword score for one generation: 1 if the hidden answer is in it."""
    return {"keyword": float(doc["keyword"] in results[0])}
