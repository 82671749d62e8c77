"""NeedleBench prompts and scoring (OpenCompass, arXiv 2407.11963), built with the model's own tokenizer.

Three tasks, as NeedleBench defines them:
- single_retrieval: one needle; score 100 if its keyword appears in the answer, else 0.
- multi_retrieval: several needles with one question each; score = % of their keywords found.
- multi_reasoning: a chain of facts that must be combined; score = % of the answer's words found
  (lower-cased), as NeedleBench's multi-needle evaluator does.

Prompts follow NeedleBench's English template: the haystack is cut to the target length in the
model's tokens, needles are inserted at the requested depth (% of the haystack, in tokens; extra
needles `spacing` % further on each, as NeedleBench's multi-needle builder does), and the question
comes last. One change: a needle goes in at the sentence boundary at or before the depth point
rather than mid-word, so the haystack stays readable (and a tokenizer cannot merge needle and
haystack tokens across the seam).
"""

from __future__ import annotations

import glob
import os
import random
import re
from dataclasses import dataclass, field

from .needles import NEEDLES, REASONING

TASKS = ("single_retrieval", "multi_retrieval", "multi_reasoning")
HUB_REPO = "opencompass/NeedleBench"
FILES = {
    "haystack": "PaulGrahamEssays.jsonl",
    "needles": "needles.jsonl",
    "reasoning": "multi_needle_reasoning_en.json",
}
_BOUNDARY = re.compile(r"[.!?](?=\s)|\n\n")


class DataError(Exception):
    """The data could not be loaded or a prompt cannot be built; the message says what to do."""


@dataclass
class NeedleData:
    haystack: list  # documents (str), concatenated in a seeded order
    needles: list  # needles.jsonl records (English)
    reasoning: list  # multi-needle reasoning records
    source: str


@dataclass
class NeedlePrompt:
    task: str
    length: int
    depth: int
    text: str
    ids: list
    keywords: list
    question: str
    context: str  # the haystack with the needles in it
    needles: list = field(default_factory=list)  # as inserted ("\n" + needle + "\n"), in order of position
    needle_at: list = field(default_factory=list)  # char offsets of the needles in `context`
    target_at: list = field(default_factory=list)  # char offsets in the haystack (without needles) the depths ask for
    needle: int | None = None  # single_retrieval over several needles: which one (index into the data's needles)


# -- data ---------------------------------------------------------------------------------
def builtin_data() -> NeedleData:
    from hf_contextpar.models import sample_text

    docs = [d for d in sample_text().split("\n\n") if d.strip()]
    return NeedleData(
        ["\n\n".join(docs)], list(NEEDLES), list(REASONING), "builtin (pydoc_data haystack, hf-contextpar needles)"
    )


def _load_json_file(path_or_name: str, data_dir: str | None):
    """One NeedleBench file through `datasets`: from a local copy if given, else the hub (or its cache)."""
    from datasets import load_dataset

    if data_dir is not None:
        hits = sorted(glob.glob(os.path.join(data_dir, "**", path_or_name), recursive=True))
        if not hits:
            raise DataError(
                f"{path_or_name} not found under --data {data_dir}. Download the dataset with "
                f"`huggingface-cli download --repo-type dataset {HUB_REPO} --local-dir {data_dir}`."
            )
        return load_dataset("json", data_files=hits[0], split="train")
    return load_dataset(HUB_REPO, data_files=path_or_name, split="train")


def hub_data(data_dir: str | None = None) -> NeedleData:
    """NeedleBench's own files (English): Paul Graham essays, needles, multi-needle reasoning sets."""
    try:
        hay = _load_json_file(FILES["haystack"], data_dir)
        needles = [r for r in _load_json_file(FILES["needles"], data_dir) if r.get("language") == "English"]
        reasoning = list(_load_json_file(FILES["reasoning"], data_dir))
    except DataError:
        raise
    except Exception as e:  # ConnectionError, FileNotFoundError, DatasetNotFoundError, ...
        where = f"--data {data_dir}" if data_dir else f"the hub ({HUB_REPO}) or its cache"
        raise DataError(
            f"could not load NeedleBench from {where}: {type(e).__name__}: {e}. Give a local copy with "
            "--data DIR, or use --source builtin for the offline haystack and needles."
        ) from None
    if not needles or not reasoning or "text" not in hay.column_names:
        raise DataError(
            "the NeedleBench files loaded but lack the expected fields (text; needle/retrieval_question/"
            "arg2/language; derivations/derivation_count/question/answer)."
        )
    return NeedleData(
        [r["text"] for r in hay], needles, reasoning, f"{HUB_REPO}" + (f" ({data_dir})" if data_dir else "")
    )


def load_data(source: str, data_dir: str | None, builtin_model: bool) -> tuple[NeedleData, str | None]:
    """(data, warning). source: "hub", "builtin", or "auto" (hub, else the built-in data, with a warning)."""
    if source == "builtin":
        return builtin_data(), None
    if source == "auto" and builtin_model and data_dir is None:
        return builtin_data(), None  # a random-weight model learns nothing from real essays; stay offline
    try:
        return hub_data(data_dir), None
    except DataError as e:
        if source == "hub" or data_dir is not None:
            raise
        return builtin_data(), f"{e} Falling back to the built-in data."


# -- prompts ------------------------------------------------------------------------------
def prompt_template(context: str, question: str, task: str) -> str:
    asks = "the questions are" if task == "multi_retrieval" else "the question is"
    return (
        "You are an intelligent AI assistant skilled in answering user questions.\n"
        "Please keep your answers concise and clear. Do not talk about irrelevant topics or repeat your answers.\n"
        f"The document given to you by the user is {context}\n\nNow, {asks}: {question}\n"
    )


def _encoder(tok, chat: bool):
    """text -> token ids the way the model is prompted (its chat template if it has one and `chat`)."""
    use_chat = chat and getattr(tok, "chat_template", None)

    def encode(text: str) -> list:
        if use_chat:
            text = tok.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            return tok(text, add_special_tokens=False).input_ids
        return tok(text).input_ids

    return encode


def boundaries(text: str) -> list:
    """Char offsets where a needle may go: the start, after each sentence end or blank line, the end."""
    return sorted({0, len(text), *(m.end() for m in _BOUNDARY.finditer(text))})


def insert_needles(context: str, context_ids: list, tok, needles: list, depths: list):
    """Insert needles at the sentence boundary at or before each depth (% of the haystack's tokens)."""
    cuts = boundaries(context)
    targets, spots = [], []
    for d in depths:
        t = len(tok.decode(context_ids[: int(len(context_ids) * d / 100)])) if d < 100 else len(context)
        t = min(t, len(context))
        targets.append(t)
        spots.append(max(c for c in cuts if c <= t))
    pieces, last, at = [], 0, []
    shift = 0
    for spot, needle in sorted(zip(spots, needles), key=lambda x: x[0]):  # stable: equal spots keep needle order
        pieces.append(context[last:spot])
        shift += spot - last
        at.append(shift)
        pieces.append(needle)
        shift += len(needle)
        last = spot
    pieces.append(context[last:])
    return "".join(pieces), at, targets


def _answer_format(question: str) -> str:
    """'The number is ______' from "... Please answer in the format 'The number is ______.'" (NeedleBench's joiner)."""
    m = re.search(r"format(?: of)? '(.*)'", question)
    return m.group(1).rstrip(".") if m else question.split("?")[0]


def _task_content(task: str, data: NeedleData, rng: random.Random, num_needles: int, reasoning_needles: int):
    """(needles, question, keywords) for one task, chosen once per run so every cell of the grid asks the same."""
    if task == "single_retrieval":
        n = rng.choice(data.needles)
        return [n["needle"]], n["retrieval_question"], [n["arg2"]]
    if task == "multi_retrieval":
        if len(data.needles) < num_needles:
            raise DataError(f"--num-needles {num_needles} but only {len(data.needles)} needles are available.")
        picked, seen = [], set()
        for n in rng.sample(data.needles, len(data.needles)):
            if n["arg1"] not in seen and n["arg2"] not in seen:
                picked.append(n)
                seen.update((n["arg1"], n["arg2"]))
            if len(picked) == num_needles:
                break
        questions = "、".join(n["retrieval_question"].split("?")[0] + "?" for n in picked)
        formats = "、".join(_answer_format(n["retrieval_question"]) for n in picked)
        return (
            [n["needle"] for n in picked],
            f"{questions} Please answer in the format of '{formats}'",
            [n["arg2"] for n in picked],
        )
    if task == "multi_reasoning":
        pool = [r for r in data.reasoning if r["derivation_count"] == reasoning_needles]
        if not pool:
            counts = sorted({r["derivation_count"] for r in data.reasoning})
            raise DataError(
                f"no multi-needle reasoning set with {reasoning_needles} needles (available: {counts}); "
                "set --reasoning-needles."
            )
        r = rng.choice(pool)
        return list(r["derivations"]), r["question"], r["answer"].lower().split()
    raise DataError(f"unknown task {task!r}; choose from {', '.join(TASKS)}.")


def haystack_ids(data: NeedleData, tok, tokens: int, seed: int) -> tuple[str, list]:
    """At least `tokens` tokens of haystack (documents in a seeded order), or all there is."""
    docs = list(data.haystack)
    random.Random(seed).shuffle(docs)
    text = "\n\n".join(docs)
    chars = max(4 * tokens, 4096)
    while True:
        ids = tok(text[:chars], add_special_tokens=False).input_ids
        if len(ids) >= tokens or chars >= len(text):
            return text[:chars], ids
        chars *= 2


def build_prompt(
    task: str, length: int, depth: int, content, hay_ids: list, tok, *, spacing: int = 10, chat: bool = True
) -> NeedlePrompt:
    """The longest NeedleBench prompt of at most `length` tokens with the needles at `depth`."""
    needles, question, keywords = content
    encode = _encoder(tok, chat)
    wrapped = ["\n" + n + "\n" for n in needles]
    depths = [min(100, depth + i * spacing) for i in range(len(needles))]
    fixed = len(encode(prompt_template("".join(wrapped), question, task)))
    budget = length - fixed
    if budget < 16:
        raise DataError(
            f"{task}: length {length} leaves no room for a haystack: the template, question and needles "
            f"alone take {fixed} tokens. Use lengths of at least {fixed + 64} (or fewer needles / other --tasks)."
        )
    if len(hay_ids) < budget:
        raise DataError(
            f"only {len(hay_ids)} tokens of haystack text are available, {budget} are needed for length "
            f"{length}. Use shorter --lengths or a larger haystack (--data / --source hub)."
        )
    for _ in range(20):
        context = tok.decode(hay_ids[:budget])
        context = context[: context.rfind(" ")] if " " in context[-16:] else context  # no half words at the cut
        context_ids = tok(context, add_special_tokens=False).input_ids
        full, at, targets = insert_needles(context, context_ids, tok, wrapped, depths)
        text = prompt_template(full, question, task)
        ids = encode(text)
        if len(ids) <= length:
            return NeedlePrompt(task, length, depth, text, ids, keywords, question, full, wrapped, at, targets)
        budget -= len(ids) - length + 1
    raise DataError(f"could not fit a prompt into {length} tokens; the tokenizer does not round-trip the haystack.")


def score(task: str, answer: str, keywords: list) -> float:
    """NeedleBench's keyword scoring, in % (see the module docstring)."""
    if task == "multi_reasoning":
        answer = answer.lower()
    found = sum(1 for k in keywords if k in answer)
    return 100.0 * found / len(keywords) if keywords else 0.0


def build_cases(
    data: NeedleData,
    tok,
    tasks,
    lengths,
    depths,
    *,
    seed=0,
    num_needles=3,
    reasoning_needles=2,
    spacing=10,
    chat=True,
    needles=None,
) -> list[NeedlePrompt]:
    """One prompt per task x length x depth; with `needles` (indices into the data's needles),
    single_retrieval gets one prompt per listed needle in every cell instead of one seeded choice,
    so a cell's score is an accuracy over needles rather than a single 0 or 100."""
    rng = random.Random(seed)
    contents = {t: _task_content(t, data, rng, num_needles, reasoning_needles) for t in tasks}
    if needles is not None:
        if bad := [i for i in needles if not 0 <= i < len(data.needles)]:
            raise DataError(f"needle indices {bad} out of range: the data has {len(data.needles)} needles.")
    variants = {t: [None] for t in tasks}
    if needles is not None and "single_retrieval" in tasks:
        variants["single_retrieval"] = list(needles)
    _, hay = haystack_ids(data, tok, max(lengths), seed)
    out = []
    for t in tasks:
        for L in lengths:
            for d in depths:
                for i in variants[t]:
                    n = data.needles[i] if i is not None else None
                    content = contents[t] if n is None else ([n["needle"]], n["retrieval_question"], [n["arg2"]])
                    prompt = build_prompt(t, L, d, content, hay, tok, spacing=spacing, chat=chat)
                    prompt.needle = i
                    out.append(prompt)
    return out
