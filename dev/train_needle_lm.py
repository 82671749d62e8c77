"""Train hf-contextpar's built-in model, `needle-lm`, from scratch on this CPU (not imported by the library).

How the shipped weights were made is told once, in the model card next to them,
hf_contextpar/assets/needle-lm/README.md: the seven runs and their commands, the data, why the recipe
looks like this, the scores, the limits, and what was tried and not kept (whose figures are in the
comments of SCHEDULES below). `training.json` beside the weights records every run.

    python dev/train_needle_lm.py --out DIR                           # the first run: from scratch
    python dev/train_needle_lm.py --init DIR --schedule NAME --out DIR2 # a later run: continue DIR

Flags:
  --out DIR          the model directory to write (config, weights, tokenizer, training.json)
  --init DIR         start from this checkpoint (weights and tokenizer) instead of from scratch
  --schedule NAME    a recipe from SCHEDULES: model size, data mix and stages (default "bigram", the first run's)
  --seed S           seed of the data and the initialisation (default 0)
  --threads N        torch threads (default: the schedule's); the weights depend on it
  --lr, --warmup     peak learning rate and warm-up steps (default: the schedule's)
  --scale-steps F    multiply every stage's steps (a quick trial: 0.02)
  --max-steps N      stop after N steps of the schedule (the learning rate still follows the full one)
  --vocab N          tokenizer size when training from scratch (default 4096)
  --work DIR         checkpoints and log (default: needle-lm-train in the temp directory, not next to OUT)
  --ckpt-every N     steps between checkpoints (default 100)
  --probe-every N    score the built-in needles every N steps (default 0: never)
  --copy-init        start layers 0-1 as an induction circuit even where the schedule does not

Reproducible: the data come from seeded `random.Random`s; with the same torch / tokenizers / Python
versions, text files and thread count the same command gives the same weights.
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import math
import os
import random
import re
import sys
import sysconfig
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hf_contextpar.eval.needlebench import prompt_template  # noqa: E402  (the harness's own prompt)

from hf_contextpar.models import heldout_topic_keys  # noqa: E402

_BOUNDARY = re.compile(r"(?<=[.!?])(?=\s)|(?=\n\n)")

# ---------------------------------------------------------------------------------------------
# text
# ---------------------------------------------------------------------------------------------


def training_documents() -> list[str]:
    """pydoc topics (minus the held-out ones), stdlib docstrings, Debian license texts; fixed order."""
    from pydoc_data.topics import topics

    held = set(heldout_topic_keys())
    docs = [topics[k] for k in sorted(topics) if k not in held]
    root = sysconfig.get_paths()["stdlib"]
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, root)
        if rel.startswith(("site-packages", "test", "idlelib", "lib2to3")) or "/test" in rel:
            continue
        try:
            tree = ast.parse(open(path, encoding="utf-8").read())
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                d = ast.get_docstring(node)
                if d and len(d) >= 300:
                    docs.append(d)
    seen = set()
    for path in sorted(glob.glob("/usr/share/common-licenses/*")):
        real = os.path.realpath(path)
        if real in seen or not os.path.isfile(real):
            continue
        seen.add(real)
        docs.append(open(real, encoding="utf-8", errors="replace").read())
    return docs


# ---------------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------------


def train_tokenizer(docs: list[str], vocab_size: int, qwen2: bool = True):
    """Byte-level BPE with digits one per token (numbers are copied digit by digit).

    `qwen2`: the pipeline of transformers' Qwen2Tokenizer (NFC, its split regex, no BOS, one
    special token <|endoftext|>), which is what `AutoTokenizer` builds for a `qwen2` model
    directory whatever its tokenizer.json says; checked here on the training text, so the
    shipped directory tokenizes the same way in training and for every user. Otherwise the first
    release's (a Llama): GPT-2's split regex after a digit split, a <s> in front.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    if qwen2:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        specials = ["<|endoftext|>"]
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
        specials = ["<s>", "</s>", "<pad>"]
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    if not qwen2:
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
        )
        return PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", model_max_length=32768
        )
    with tempfile.TemporaryDirectory() as d:
        tok.save(os.path.join(d, "tokenizer.json"))
        out = Qwen2Tokenizer.from_pretrained(d, model_max_length=32768)
    sample = docs[:50] + ["pier 4096\n\n\tx  y\r\n\u00e9\u0301 'll (list) 3.14"]
    if [tok.encode(t).ids for t in sample] != out(sample).input_ids or len(out) != vocab_size:
        raise SystemExit("the trained BPE and transformers' Qwen2Tokenizer over it disagree")
    return out


# ---------------------------------------------------------------------------------------------
# invented facts in NeedleBench's form
# ---------------------------------------------------------------------------------------------

SYLLABLES = (
    "ba be bi bo bra bri ca ce co cor da de di dor el en fa fe fen fi ga gar ha hal he ka ke ki "
    "la le li lo lun ma me mi mo mor na ne ni no nor o pa pe pi po qua ra re ri ro ros sa se "
    "sel si so ta te ti to tor u va ve vi vo wen wi ya yo za ze zo"
).split()
PLACE_SUFFIX = (
    "Point Hollow Bay College Street Harbor Valley Ridge Market Abbey Crossing Green Mill Station "
    "Heights Creek Forest Island Square Castle Fields Manor Wharf Gate"
).split()
TITLES = "Professor Captain Doctor Mrs. Mr. Grandmother Uncle Aunt Sister Brother Judge Mayor Lady Sir".split()
THINGS = (
    "ledger bicycle telescope kettle violin bakery clock tower library orchard museum bridge notebook carpet "
    "window choir garden boat barn cellar attic workshop piano lamp mirror fountain wagon theatre school "
    "kitchen chapel radio compass map trunk cabinet quilt drum flute tent canoe sled"
).split()
ADJECTIVES = (
    "red blue green yellow amber silver golden crimson scarlet ivory black white grey purple orange "
    "emerald bronze iron wooden glass marble velvet woollen tiny giant ancient frozen burnt salted "
    "sweet bitter hollow broken painted striped spotted quiet sleepy brave clever"
).split()
NOUNS = (
    "falcon otter badger walrus pelican lynx salmon beetle tortoise sparrow camel donkey rabbit "
    "lantern anchor compass teapot kite harp trumpet banner crown feather pebble acorn thistle tulip "
    "orchid lily maple cedar willow saffron nutmeg ginger basil clove fennel pepper walnut almond "
    "balloon carriage submarine airship tram rocket"
).split()
NUMBER_WORDS = "one two three four five six seven eight nine ten eleven twelve twenty thirty fifty ninety".split()
ORDINALS = ("first second third fourth fifth sixth seventh eighth tenth twelfth fifteenth twentieth").split()

# (needle, question, answer prefix, answer kind); {S} subject, {T} a thing, {A} the answer
RELATIONS = [
    (
        "{S} writes the number {A} on every {T} in the house.",
        "What number does {S} write on every {T} in the house?",
        "The number is",
        "num",
    ),
    ("The pass key of {S} is {A}.", "What is the pass key of {S}?", "The pass key is", "num"),
    ("{S} lives at house number {A}.", "At which house number does {S} live?", "The house number is", "num"),
    (
        "The {T} from {S} always leaves from platform {A}.",
        "From which platform does the {T} from {S} leave?",
        "It leaves from platform",
        "num",
    ),
    (
        "{S} counted exactly {A} birds on the roof of the {T}.",
        "How many birds did {S} count on the roof of the {T}?",
        "The count is",
        "num",
    ),
    ("The lucky number of {S} is {A}.", "What is the lucky number of {S}?", "The lucky number is", "num"),
    ("{S} opened the {T} with the code {A}.", "What code did {S} use to open the {T}?", "The code is", "num"),
    (
        "The year carved above the door of the {T} in {S} is {A}.",
        "What year is carved above the door of the {T} in {S}?",
        "The year is",
        "num",
    ),
    (
        "The secret ingredient in the soup of {S} is {A}.",
        "What is the secret ingredient in the soup of {S}?",
        "The secret ingredient is",
        "phrase",
    ),
    (
        "{S} picked {A} as the emblem of the {T}.",
        "What did {S} pick as the emblem of the {T}?",
        "The emblem is",
        "phrase",
    ),
    ("{S} hides the {T} inside {A}.", "Where does {S} hide the {T}?", "The {T} is inside", "place"),
    ("The password for the {T} of {S} is {A}.", "What is the password for the {T} of {S}?", "The password is", "word"),
    (
        "The old painting in the {T} of {S} shows {A}.",
        "What does the old painting in the {T} of {S} show?",
        "It shows",
        "phrase",
    ),
    ("The {T} fair in {S} is always held on {A}.", "On which day is the {T} fair in {S} held?", "It is held on", "day"),
    (
        "The favourite animal of {S} is {A}.",
        "What is the favourite animal of {S}?",
        "The favourite animal is",
        "phrase",
    ),
    ("{S} named the new {T} {A}.", "What did {S} name the new {T}?", "The name is", "name"),
    ("The {T} of {S} is made of {A}.", "What is the {T} of {S} made of?", "It is made of", "phrase"),
    (
        "Every morning {S} feeds {A} to the goats.",
        "What does {S} feed to the goats every morning?",
        "The food is",
        "phrase",
    ),
    ("The {T} of {S} is kept in the town of {A}.", "In which town is the {T} of {S} kept?", "The town is", "name"),
    (
        "The mascot of the {T} club in {S} is {A}.",
        "What is the mascot of the {T} club in {S}?",
        "The mascot is",
        "phrase",
    ),
]
PASSKEY = ("The pass key is {A}. Remember it. {A} is the pass key.", "What is the pass key?", "The pass key is", "num")


# Relations made up per fact ("generated"): the answer at the start, middle or end of the
# sentence, before or after the word the question asks about, so the model must learn which span
# of the needle the question leaves open instead of the 20 fixed forms above.
VERBS = [  # base, third person, past
    (v, v + "es" if v.endswith(("sh", "ch", "s")) else v + "s", past)
    for v, past in (
        ("keep", "kept"),
        ("paint", "painted"),
        ("hide", "hid"),
        ("carry", "carried"),
        ("store", "stored"),
        ("write", "wrote"),
        ("sell", "sold"),
        ("draw", "drew"),
        ("bake", "baked"),
        ("collect", "collected"),
        ("plant", "planted"),
        ("place", "placed"),
        ("bury", "buried"),
        ("find", "found"),
        ("build", "built"),
        ("send", "sent"),
        ("wear", "wore"),
        ("read", "read"),
        ("choose", "chose"),
        ("feed", "fed"),
        ("bring", "brought"),
        ("carve", "carved"),
        ("buy", "bought"),
        ("stitch", "stitched"),
        ("polish", "polished"),
    )
]
VERBS = [(b, t.replace("carrys", "carries").replace("burys", "buries"), p) for b, t, p in VERBS]
ROLES = (
    "mascot emblem motto password code colour symbol nickname charm signal keyword flag seal toast "
    "treasure secret prize rule"
).split()
PREPS = ("in", "on", "under", "behind", "beside", "inside", "near", "for")
ANSWER_KINDS = ("num", "word", "name", "place", "phrase", "phrase", "num")


def generated_relation(rng: random.Random, forms: int = 6) -> tuple[str, str, str, str]:
    """One made-up relation: (needle, question, answer frame, answer kind) templates over {S}, {T}, {A}.
    `forms`: 6, or 8 with the two where the question names the role before the subject."""
    base, third, past = rng.choice(VERBS)
    role, prep, kind = rng.choice(ROLES), rng.choice(PREPS), rng.choice(ANSWER_KINDS)
    form = rng.randrange(forms)
    if form == 6:  # the role asked about first ("What mascot did the club choose?"), "as its" role
        return (
            f"{{S}} {past} {{A}} as its {role}.",
            f"What {role} did {{S}} {base}?",
            f"The {role} is",
            kind,
        )
    if form == 7:  # the same, the role named in the needle before the answer
        return (
            f"For its {role}, {{S}} {past} {{A}}.",
            f"Which {role} did {{S}} {base}?",
            rng.choice([f"The {role} is", f"{{S}} {past}"]),
            kind,
        )
    if form == 0:  # answer after the verb, a place after it
        return (
            f"{{S}} {third} {{A}} {prep} the {{T}}.",
            f"What does {{S}} {base} {prep} the {{T}}?",
            rng.choice([f"{{S}} {third}", "It is", f"The {role} is"]),
            kind,
        )
    if form == 1:  # answer before the word asked about ("chose a copper heron as its mascot")
        return (
            f"{{S}} {past} {{A}} as the {role} of the {{T}}.",
            f"What did {{S}} {base} as the {role} of the {{T}}?",
            f"The {role} is",
            kind,
        )
    if form == 2:  # a cleft sentence: the answer right after "It was"
        return (
            f"It was {{A}} that {{S}} {past} {prep} the {{T}}.",
            f"What did {{S}} {base} {prep} the {{T}}?",
            rng.choice(["It is", f"{{S}} {past}"]),
            kind,
        )
    if form == 3:  # answer at the end, after a long description
        return (
            f"The {role} that {{S}} {third} {prep} every {{T}} is {{A}}.",
            f"What is the {role} that {{S}} {third} {prep} every {{T}}?",
            f"The {role} is",
            kind,
        )
    if form == 4:  # "where": the answer is the place
        return (
            f"{{S}} {third} the {{T}} {prep} {{A}}.",
            f"Where does {{S}} {base} the {{T}}?",
            f"The {{T}} is {prep}",
            "place",
        )
    return (  # the subject last
        f"Every year the {{T}} of {{S}} gets {{A}} as its {role}.",
        f"What does the {{T}} of {{S}} get as its {role} every year?",
        rng.choice([f"The {role} is", "It gets"]),
        kind,
    )


def invented_name(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


PLAIN_ADJECTIVES = "famous old new little favourite secret annual oldest busy quiet".split()


def subject(rng: random.Random, rich: float = 0.0) -> str:
    """Who or what a fact is about; `rich`: the share that is a longer noun phrase around a name
    ("Osei's famous kettle", "the cellar at Bramo Point"), so that the words before the answer vary."""
    if rich and rng.random() < rich:
        r = rng.random()
        if r < 0.4:
            return f"{rng.choice(TITLES + [''])} {invented_name(rng)}'s {rng.choice(PLAIN_ADJECTIVES)} {rng.choice(THINGS)}".strip()
        if r < 0.7:
            return f"the {rng.choice(THINGS)} at {invented_name(rng)} {rng.choice(PLACE_SUFFIX)}"
        return f"the {rng.choice(THINGS)} {rng.choice(['club', 'society', 'guild'])} of {invented_name(rng)} {rng.choice(PLACE_SUFFIX)}"
    r = rng.random()
    if r < 0.35:
        return f"{invented_name(rng)} {rng.choice(PLACE_SUFFIX)}"
    if r < 0.7:
        return f"{rng.choice(TITLES)} {invented_name(rng)}"
    return f"{invented_name(rng)} {invented_name(rng)}"


def open_vocabulary(docs: list[str]) -> list[str]:
    """Answer words too many to memorise: the training text's lowercase words (3-12 letters, seen at
    least twice), minus every word of the built-in needles' answers, so those stay unseen as answers.

    With answers from the short lists above only, the model learnt a prior over them and answered
    from it instead of copying ("smoked cardamom" came out as "burnt teapot", "marigold-forty" as
    "boatwer": both unlike any list word, while the needles whose answers copy token by token passed).
    """
    from collections import Counter

    from hf_contextpar.eval.needles import NEEDLES, REASONING

    held = {w.lower() for n in NEEDLES for w in re.findall(r"[A-Za-z]+", n["arg2"])}
    held |= {w.lower() for r in REASONING for w in re.findall(r"[A-Za-z]+", r["answer"])}
    counts = Counter(w for d in docs for w in re.findall(r"\b[a-z]{3,12}\b", d))
    return sorted(w for w, c in counts.items() if c >= 2 and w not in held)


def answer(kind: str, rng: random.Random, words: list[str] | None = None) -> str:
    """A random answer of `kind`; with `words`, its words come from that open vocabulary instead of the lists."""
    if kind == "num":
        digits = rng.randint(1, 6)
        return str(rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1))
    if kind == "name":
        return invented_name(rng)
    if kind == "day":
        return f"the {rng.choice(ORDINALS)} of {invented_name(rng)}"
    adjectives, nouns = (words, words) if words else (ADJECTIVES, NOUNS)
    if kind == "word":
        return f"{rng.choice(words or NOUNS + ADJECTIVES)}-{rng.choice(words or NUMBER_WORDS)}"
    if kind == "place":
        return f"a {rng.choice(adjectives)} {rng.choice(nouns)}"
    if words and rng.random() < 0.25:
        return rng.choice(words)
    return (
        f"{rng.choice(adjectives)} {rng.choice(nouns)}"
        if rng.random() < 0.8
        else f"{invented_name(rng).lower()} {rng.choice(nouns)}"
    )


FRAMES = (
    "The answer is",
    "It is",
    "The value is",
    "The result is",
    "The reply is",
    "It reads",
    "Answer:",
    "I believe it is",
    "They say it is",
    "What I found is",
)


def answer_frame(rng: random.Random) -> str:
    """An answer frame the model can only get right by copying it from the question's format string:
    a generic one, or a few random words (the relation's own frame is memorised within a few hundred steps)."""
    if rng.random() < 0.5:
        return rng.choice(FRAMES)
    words = [rng.choice(THINGS + NOUNS + ADJECTIVES) for _ in range(rng.randint(1, 3))]
    return " ".join([words[0].capitalize(), *words[1:], rng.choice(["is", "was", "reads", ":"])])


def fact(
    rng: random.Random,
    passkey: bool = False,
    frames: float = 0.0,
    generated: float = 0.0,
    words: list[str] | None = None,
    open_share: float = 0.0,
    rich: float = 0.0,
    forms: int = 6,
    articles: float = 0.0,
) -> dict:
    """One invented fact; `frames`: the share whose answer frame is not the relation's own (answer_frame);
    `generated`: the share whose relation is made up (generated_relation); `open_share`: the share whose
    answer words come from `words` (open_vocabulary); `rich`: subject()'s share of longer subjects;
    `forms`: generated_relation's; `articles`: the share of word and phrase answers given an article
    ("a copper heron": the answer starts one word before its content)."""
    if passkey:
        needle, question, prefix, kind = PASSKEY
    elif generated and rng.random() < generated:
        needle, question, prefix, kind = generated_relation(rng, forms)
    else:
        needle, question, prefix, kind = rng.choice(RELATIONS)
    slots = dict(S=subject(rng, rich), T=rng.choice(THINGS))
    slots["A"] = answer(kind, rng, words if open_share and rng.random() < open_share else None)
    if articles and kind in ("word", "phrase") and rng.random() < articles:
        slots["A"] = f"{rng.choice(['a', 'the', 'an', 'one'])} {slots['A']}"
    fill = lambda s: s.format(**slots)  # noqa: E731
    if frames and rng.random() < frames:
        prefix = answer_frame(rng)
    return dict(needle=fill(needle), question=fill(question), prefix=fill(prefix), answer=slots["A"])


def single_question(f: dict) -> tuple[str, str]:
    """(question, reply) for one fact, in the built-in needles' form."""
    return f"{f['question']} Please answer in the format '{f['prefix']} ______.'", f"{f['prefix']} {f['answer']}."


# ---------------------------------------------------------------------------------------------
# episodes and packed sequences
# ---------------------------------------------------------------------------------------------


class Corpus:
    """The training text pre-tokenised as sentence pieces, so haystacks are cut at sentence boundaries."""

    def __init__(self, docs, tok):
        pieces = []
        for d in docs:
            pieces.extend(p for p in _BOUNDARY.split(d) if p)
            pieces.append("\n\n")
        self.pieces = tok(pieces, add_special_tokens=False).input_ids
        self.tokens = sum(len(p) for p in self.pieces)
        self.newline = tok("\n", add_special_tokens=False).input_ids

    def haystack(self, rng: random.Random, n_tokens: int) -> list[list[int]]:
        i, out, have = rng.randrange(len(self.pieces)), [], 0
        while have < n_tokens:
            p = self.pieces[i % len(self.pieces)]
            out.append(p)
            have += len(p)
            i += 1
        return out


class Episodes:
    """One NeedleBench-style prompt + answer as token ids, with a loss mask on the answer."""

    def __init__(self, corpus: Corpus, tok, **fact_args):
        self.corpus, self.tok = corpus, tok
        self.fact_args = {"frames": 0.0, **fact_args}  # fact()'s keywords
        head = prompt_template("\x00", "\x01", "single_retrieval").split("\x00")[0]
        self.head = tok(head).input_ids  # <s> + instructions + "The document given to you by the user is"
        self.eos = tok.eos_token_id
        self.enc = lambda s: tok(s, add_special_tokens=False).input_ids  # noqa: E731

    def document(self, rng: random.Random, facts: list, hay_tokens: int):
        """The prompt's head and a haystack with the facts' needles at random sentence boundaries:
        (ids, cut_ok), cut_ok marking where PoSE may skip positions (haystack sentence starts)."""
        pieces = self.corpus.haystack(rng, hay_tokens)
        spots = sorted(rng.randint(0, len(pieces)) for _ in facts)
        ids, cut_ok = list(self.head), [False] * len(self.head)
        order = rng.sample(facts, len(facts))
        k = 0
        for i in range(len(pieces) + 1):
            while k < len(spots) and spots[k] == i:
                needle = self.enc("\n" + order[k]["needle"] + "\n")
                ids += needle
                cut_ok += [False] * len(needle)
                k += 1
            if i < len(pieces):
                cut_ok += [True] + [False] * (len(pieces[i]) - 1)
                ids += pieces[i]
        return ids, cut_ok

    def make(self, rng: random.Random, hay_tokens: int, multi_prob: float):
        n = rng.choices([1, 2, 3, 4], weights=[4, 3, 2, 1])[0]
        facts, subjects = [], set()
        if rng.random() < 0.1:
            facts.append(fact(rng, passkey=True, frames=self.fact_args["frames"]))
        while len(facts) < n:
            f = fact(rng, **self.fact_args)
            if f["needle"].split(" ")[0:3] != [] and f["answer"] not in {g["answer"] for g in facts}:
                key = f["question"]
                if key not in subjects:
                    subjects.add(key)
                    facts.append(f)
        if n >= 2 and rng.random() < multi_prob:
            asked = rng.sample(facts, rng.randint(2, n))
            task = "multi_retrieval"
            question = "、".join(f["question"].split("?")[0] + "?" for f in asked)
            question += " Please answer in the format of '" + "、".join(f["prefix"] + " ______" for f in asked) + "'"
            reply = "、".join(f"{f['prefix']} {f['answer']}" for f in asked) + "."
        else:
            task = "single_retrieval"
            question, reply = single_question(rng.choice(facts))
        ids, cut_ok = self.document(rng, facts, hay_tokens)
        tail = prompt_template("\x00", question, task).split("\x00")[1]
        tail_ids = self.enc(tail)
        ids += tail_ids
        cut_ok += [False] * len(tail_ids)
        ans = self.enc(reply) + [self.eos]
        is_answer = [False] * len(ids) + [True] * len(ans)
        ids += ans
        cut_ok += [False] * len(ans)
        return ids, is_answer, cut_ok

    def make_dense(self, rng: random.Random, hay_tokens: int, max_facts: int = 8):
        """One document with several needles, then one question after another, each answered.

        The densest retrieval signal: every question needs the needle of its own subject among
        several of the same form (so the match is on the subject, not on "the odd sentence"), and
        a sequence carries several answers instead of one. Each question and reply is laid out
        exactly as the single-needle prompt ends ("\n\nNow, the question is: ...\n" + reply + EOS).
        """
        n = rng.randint(2, max_facts)
        facts, seen = [], set()
        while len(facts) < n:
            f = fact(rng, passkey=not facts and rng.random() < 0.1, **self.fact_args)
            if f["answer"] not in seen and f["question"] not in seen:
                seen.update((f["answer"], f["question"]))
                facts.append(f)
        ids, _ = self.document(rng, facts, hay_tokens)
        ans = [False] * len(ids)
        for f in rng.sample(facts, rng.randint(max(1, n // 2), n)):
            question, reply = single_question(f)
            tail = self.enc(prompt_template("\x00", question, "single_retrieval").split("\x00")[1])
            reply = self.enc(reply) + [self.eos]
            ids += tail + reply
            ans += [False] * len(tail) + [True] * len(reply)
        return ids, ans, [False] * len(ids)


def copy_episode(rng, corpus: Corpus, hay_tokens: int):
    """Dense induction signal: a stretch of text, then a span of it repeated; loss on the repeat after a 3-token cue.

    The needle answers are copied the same way (find where the cue occurred, copy what followed);
    answer tokens alone are too sparse a signal for the copy heads to form in a short run.
    """
    flat = [t for p in corpus.haystack(rng, hay_tokens) for t in p][:hay_tokens]
    n = rng.randint(8, 24)
    start = rng.randint(0, max(0, len(flat) - n))
    span = flat[start : start + n]
    ids = flat + corpus.newline + span
    is_copy = [False] * (len(flat) + len(corpus.newline) + 3) + [True] * (len(span) - 3)
    cut_ok = [False] * len(ids)
    return ids, is_copy, cut_ok


def repeat_sequence(rng, corpus: Corpus, seq_len: int, vocab: int, text_share: float = 0.5, spread: bool = False):
    """Copy signal: spans of random tokens (or text) that occur twice; loss on the repeats.

    Marks: 1 loss (the repeat), 0 LM loss allowed, 2 no loss. `spread=False` (the shipped
    weights): one span of L/2 repeated, LM loss allowed on the first span. That has a shortcut:
    the repeat is always L/2 back, and a model can copy by position instead of by content (a
    wide-model try reached copy accuracy 1.00 at 256 tokens and 0.00 at 512 and 1,024).
    `spread=True`: spans of 8-64 tokens repeated 1-L/2 tokens further on, no loss on the random
    tokens, so only content-based copying (an induction head) helps; see SCHEDULES for how it went.
    """
    if not spread:
        n = seq_len // 2
        if rng.random() < 1 - text_share:
            span = [rng.randrange(3, vocab) for _ in range(n)]
        else:
            span = [t for p in corpus.haystack(rng, n) for t in p][:n]
        ids = (span + span + span)[:seq_len]
        return ids, [0] * (n + 1) + [1] * (seq_len - n - 1), list(range(seq_len))
    if rng.random() >= text_share:
        ids, free = [rng.randrange(3, vocab) for _ in range(seq_len)], 2
    else:
        ids, free = [t for p in corpus.haystack(rng, seq_len) for t in p][:seq_len], 0
    mark = [free] * seq_len
    at = rng.randint(0, 16)
    while True:
        n = rng.randint(8, 64)
        gap = rng.randint(1, seq_len // 2)
        if at + 2 * n + gap > seq_len:
            break
        ids[at + n + gap : at + 2 * n + gap] = ids[at : at + n]
        mark[at + n + gap + 1 : at + 2 * n + gap] = [1] * (n - 1)
        at += n + rng.randint(0, n)  # the next span starts inside or after this one's gap
    return ids, mark, list(range(seq_len))


def pack(
    rng,
    episodes: Episodes,
    seq_len: int,
    hay_range,
    multi_prob: float,
    max_span: int,
    pose_prob: float,
    copy_prob: float = 0.0,
    repeat_prob: float = 0.0,
    dense_prob: float = 0.0,
    repeat_text: float = 0.5,
    spread: bool = False,
):
    """seq_len tokens of episodes (the last topped up with plain text), position ids with PoSE skips."""
    if rng.random() < repeat_prob:
        return repeat_sequence(rng, episodes.corpus, seq_len, len(episodes.tok), repeat_text, spread)
    ids, ans, cut = [], [], []
    while seq_len - len(ids) > 160:
        room = seq_len - len(ids)
        hay = rng.randint(hay_range[0], hay_range[1])
        hay = min(hay, max(16, room - 200))
        r = rng.random()
        if r < copy_prob:
            e_ids, e_ans, e_cut = copy_episode(rng, episodes.corpus, min(hay, room - 30))
        elif r < copy_prob + dense_prob:
            facts = max(2, min(8, (room - hay - 60) // 70))  # ~70 tokens a needle + its question and reply
            e_ids, e_ans, e_cut = episodes.make_dense(rng, hay, facts)
            while len(e_ids) > room and (facts > 2 or hay > 16):
                facts, hay = max(2, facts - 2), max(16, hay // 2)
                e_ids, e_ans, e_cut = episodes.make_dense(rng, hay, facts)
        else:
            e_ids, e_ans, e_cut = episodes.make(rng, hay, multi_prob)
        if len(e_ids) > room:
            if ids:
                break
            e_ids, e_ans, e_cut = e_ids[-room:], e_ans[-room:], e_cut[-room:]
        ids += e_ids
        ans += e_ans
        cut += e_cut
    while len(ids) < seq_len:
        p = episodes.corpus.haystack(rng, seq_len - len(ids))
        flat = [t for piece in p for t in piece][: seq_len - len(ids)]
        cut += [True] + [False] * (len(flat) - 1)
        ids += flat
        ans += [False] * len(flat)
    pos = list(range(seq_len))
    if rng.random() < pose_prob and max_span > seq_len:
        candidates = [i for i, c in enumerate(cut) if c and i > 0]
        if candidates:
            cuts = sorted(rng.sample(candidates, min(len(candidates), rng.randint(1, 3))))
            extra = rng.randint(0, max_span - seq_len)
            shares = sorted(rng.randint(0, extra) for _ in range(len(cuts) - 1)) + [extra]
            skips = [b - a for a, b in zip([0] + shares[:-1], shares)]
            offset, j = 0, 0
            for i in range(seq_len):
                while j < len(cuts) and cuts[j] == i:
                    offset += skips[j]
                    j += 1
                pos[i] = i + offset
    return ids, ans, pos


# ---------------------------------------------------------------------------------------------
# model and training
# ---------------------------------------------------------------------------------------------


SIZES = {  # hidden, intermediate, query heads (2 KV heads, head_dim 32, 4 layers in all)
    "small": (128, 384, 4),
    "wide": (192, 512, 8),
}


def make_config(vocab_size: int, tok, size: str = "small", window: int | None = None, theta: float = 5e5):
    """A Llama (window None), or a Qwen2 (a Llama with QKV bias) whose layer 0 attends to the last
    `window` tokens only: the previous-token head an induction circuit needs then stays local at any
    length, where a RoPE-only positional head spreads its weight over the whole context (at 16K
    tokens a hand-set one keeps under 10% on the previous token)."""
    from transformers import LlamaConfig, Qwen2Config

    hidden, inter, heads = SIZES[size]
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=4,
        num_attention_heads=heads,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": float(theta)},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        initializer_range=0.02,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    if window is None:
        return LlamaConfig(**common, attention_bias=False, mlp_bias=False)
    return Qwen2Config(
        **common,
        use_sliding_window=True,
        sliding_window=window,
        max_window_layers=0,
        layer_types=["sliding_attention"] + ["full_attention"] * 3,
    )


@torch.no_grad()
def grow(model, layers: int):
    """The same function with `layers` more full-attention layers on top: each new layer starts with
    zero output projections (o_proj, down_proj), so it adds nothing until training gives it a use."""
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    config.num_hidden_layers += layers
    config.layer_types = list(config.layer_types) + ["full_attention"] * layers
    bigger = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    missing, unexpected = bigger.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all(".layers." in k for k in missing), (missing, unexpected)
    for layer in bigger.model.layers[-layers:]:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    return bigger.to(model.dtype)


# A schedule: the model size, how repeats are built (repeat_sequence's `spread`), and its stages:
# (steps, seq_len, batch, haystack tokens min/max per episode, multi-question share, PoSE span, PoSE share,
#  share of copy episodes, share of repeat sequences, share of dense episodes, share of text among repeats,
#  LM loss weight)
SCHEDULES = {
    # the first release's weights (a Llama; step 1,250 of this schedule): retrieval not learned
    "first-release": dict(
        size="small",
        spread=False,
        stages=[
            (60, 512, 4, (16, 160), 0.1, 512, 0.0, 0.3, 0.6, 0.0, 0.5, 0.3),
            (150, 512, 8, (16, 240), 0.2, 2048, 0.3, 0.3, 0.15, 0.0, 0.5, 0.3),
            (150, 512, 8, (32, 400), 0.25, 8192, 0.5, 0.2, 0.05, 0.0, 0.5, 0.3),
            (140, 1024, 4, (64, 900), 0.25, 16384, 0.6, 0.15, 0.0, 0.0, 0.5, 0.3),
            (100, 2048, 2, (256, 1900), 0.25, 20000, 0.7, 0.1, 0.0, 0.0, 0.5, 0.3),
        ],
    ),
    # Tries of 2026-11-23 (wide model, lr 2e-3, warm-up 30; none reached retrieval; the model card,
    # hf_contextpar/assets/needle-lm/README.md, has the figures). "fixed-warmup": random-token repeats only, then dense
    # episodes: copy accuracy 1.00 at step 250, but by position (0.00 at 512 tokens), and the
    # first episode steps left nothing of it. "spread-warmup": spans at random distances, so only
    # an induction head helps: still at chance (loss 8.31 = ln 4096) after 630 steps, 1.3 M tokens.
    "fixed-warmup": dict(
        size="wide",
        spread=False,
        stages=[
            (250, 256, 8, (16, 100), 0.0, 256, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0),
            (700, 512, 8, (16, 200), 0.1, 2048, 0.2, 0.05, 0.15, 0.6, 0.0, 0.3),
            (400, 1024, 4, (64, 700), 0.1, 8192, 0.5, 0.05, 0.1, 0.5, 0.0, 0.3),
            (250, 2048, 2, (256, 1900), 0.1, 20000, 0.7, 0.0, 0.05, 0.5, 0.0, 0.3),
        ],
    ),
    "spread-warmup": dict(
        size="wide",
        spread=True,
        stages=[
            (700, 256, 8, (16, 100), 0.0, 256, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0),
            (450, 512, 8, (16, 200), 0.1, 2048, 0.2, 0.05, 0.3, 0.5, 0.0, 0.2),
            (250, 1024, 4, (64, 700), 0.1, 8192, 0.5, 0.05, 0.2, 0.5, 0.0, 0.2),
            (150, 2048, 2, (256, 1900), 0.1, 20000, 0.7, 0.0, 0.1, 0.5, 0.0, 0.2),
        ],
    ),
    # A Qwen2 whose layer 0 sees 2 tokens, started as a copy circuit (init_copy_circuit): it copies
    # from step 0, so the episodes teach what to copy instead of waiting for the circuit to form.
    # 2,250 steps, 9.2 M tokens, 24 min on 2 threads (the shipped weights' first part, see
    # "windowed-more"): single-needle 12.5 / 15 / 0-2.5% at 512 / 1,024 / 2-16K tokens. A 3,650-step
    # run of this recipe with the first tokenizer (1,800 / 1,000 / 700 steps in stages 1-3) probed
    # 33 / 25 / 4% at 512 / 1,024 / 2,048.
    "windowed": dict(
        size="small",
        spread=True,
        window=2,
        copy_init=True,
        gain=6.0,
        lr=1e-3,
        warmup=30,
        threads=2,
        stages=[
            (150, 256, 16, (16, 100), 0.0, 256, 0.0, 0.0, 1.0, 0.0, 0.3, 0.0),
            (1300, 512, 8, (16, 300), 0.1, 2048, 0.2, 0.05, 0.3, 0.5, 0.3, 0.3),
            (500, 1024, 4, (64, 800), 0.1, 8192, 0.5, 0.05, 0.2, 0.5, 0.3, 0.3),
            (300, 2048, 2, (256, 1900), 0.1, 20000, 0.7, 0.0, 0.1, 0.5, 0.3, 0.3),
        ],
    ),
}
# The shipped weights: the "windowed" weights continued (`--init <their directory>`, 1,950 steps,
# 8.0 M tokens, 22 min on 2 threads). Those answered in the relation's own frame ("The secret
# ingredient is") whatever the question's format string asked for, so half the facts get another
# frame (answer_frame), which only copying the format string gets right; denser episodes, fewer
# repeats. Single-needle score on the harness's 8 needles x 5 depths, before -> after: 12.5 -> 35%
# at 512 tokens, 15 -> 35% at 1,024, 0 -> 12.5% at 2,048. The same continuation without the frames
# (1,700 steps) probed 17-25% / 12.5% at 512 / 1,024 (8 needles x 3 depths): no better than before.
SCHEDULES["windowed-more"] = dict(
    SCHEDULES["windowed"],
    frames=0.5,
    lr=6e-4,
    stages=[
        (1400, 512, 8, (16, 300), 0.1, 2048, 0.2, 0.05, 0.15, 0.65, 0.3, 0.3),
        (400, 1024, 4, (64, 800), 0.1, 8192, 0.5, 0.05, 0.1, 0.6, 0.3, 0.3),
        (150, 2048, 2, (256, 1900), 0.1, 20000, 0.7, 0.0, 0.05, 0.6, 0.3, 0.3),
    ],
)

# The shipped weights' recipe (2026-11-24), from scratch, then continued ("bigram-more").
# "long-theta": RoPE theta 1e9 instead of 5e5, so that the induction head's 16 slowest dims stay
# unrotated over 16K tokens (at 5e5 only 8 do: theta_j * 16,384 < 1 needs j >= 12 of 16 pairs),
# and the answer frames from the start. At init (before any training), on random tokens with one
# 32-token span repeated 6,000 tokens back, the circuit copies 39% of the repeat at theta 1e9 and
# 0% at 5e5. "bigram": the same with a two-token match (layer 0 sees 3 tokens; init_copy_circuit's
# `bigram`). Run side by side, one thread each (2,450 steps, 10.0 M tokens, 42 min), probed on
# the 8 built-in needles x 5 depths at 512 / 1,024 / 2,048 / 4,096 tokens:
#   long-theta  62.5 / 35 / 10 / 5%
#   bigram      50 / 50 / 42.5 / 40%   (flat in length: the two-token match keeps long answers on the needle)
# (the "windowed" run before them, 5e5 and a one-token match: 12.5 / 15 / 0 / 2.5%).
SCHEDULES["long-theta"] = dict(
    SCHEDULES["windowed"],
    theta=1e9,
    frames=0.5,
    threads=1,
    stages=[
        (150, 256, 16, (16, 100), 0.0, 256, 0.0, 0.0, 1.0, 0.0, 0.3, 0.0),
        (1500, 512, 8, (16, 300), 0.1, 2048, 0.2, 0.05, 0.2, 0.6, 0.3, 0.3),
        (500, 1024, 4, (64, 800), 0.1, 8192, 0.5, 0.05, 0.1, 0.6, 0.3, 0.3),
        (300, 2048, 2, (256, 1900), 0.1, 20000, 0.7, 0.0, 0.05, 0.6, 0.3, 0.3),
    ],
)
SCHEDULES["bigram"] = dict(SCHEDULES["long-theta"], window=3, bigram=True)
# Their continuations (--init): the windowed-more stages, a third of the facts in made-up relations.
for _name in ("long-theta", "bigram"):
    SCHEDULES[_name + "-more"] = dict(
        SCHEDULES["windowed-more"],
        **{k: v for k, v in SCHEDULES[_name].items() if k in ("theta", "window", "bigram")},
        generated=0.3,
        stages=[
            (1200, 512, 8, (16, 300), 0.1, 2048, 0.2, 0.05, 0.15, 0.65, 0.3, 0.3),
            (400, 1024, 4, (64, 800), 0.1, 8192, 0.5, 0.05, 0.1, 0.6, 0.3, 0.3),
            (300, 2048, 2, (256, 1900), 0.1, 20000, 0.7, 0.0, 0.05, 0.6, 0.3, 0.3),
        ],
    )

# Three continuations of the third run's weights ("more2" in the docstring; 4 layers), 2026-11-24,
# probed on the 8 built-in needles x 5 depths at 512 / 1,024 / 2,048 / 4,096 tokens; "more2" itself:
# 62.5 / 62.5 / 62.5 / 52.5%.
# "bigram-open" (tried, not kept; seed 2, 2 threads, 21 min): half the answers'
# words from the open vocabulary (open_vocabulary): 62.5 / 60 / 60 / 47.5%. The prior went (no more "burnt teapot"), but the same three needles still fail: the
# answer is copied from the wrong place ("The mascot is skilled in answering user", from the prompt's
# instructions). What fails is finding where the answer starts when the needle's words just before
# it are not the answer frame's ("... plum cake is smoked cardamom" asked as "The secret ingredient
# is"); the same holds for training relations of that shape (secret ingredient, emblem, password,
# name, food, mascot: 0-2 of 6 at 512 tokens, the other 14 relations 5-6 of 6).
SCHEDULES["bigram-open"] = dict(SCHEDULES["bigram-more"], open_share=0.5)
# "bigram-deeper" (kept; seed 3, 2 threads, 25 min, 7.8 M tokens): two more full-attention layers
# on top (`grow`: zero output projections, so the function is unchanged at step 0), then the
# bigram-more stages: 62.5 / 62.5 / 62.5 / 55%, the same three needles failing, but the training
# relations of that shape went up (mascot 1 -> 4 of 4, secret ingredient 0 -> 3 of 4 at 512 tokens).
SCHEDULES["bigram-deeper"] = dict(SCHEDULES["bigram-more"], grow=2)
# "bigram-rich" (kept; seed 4, 2 threads, 26 min, 7.8 M tokens): on the deeper weights,
# half the subjects are phrases of several words around a name (subject()'s `rich`: "Lady Osa's
# famous kettle", "the barn at Dori Point"), so that the words just before an answer are not always
# a name: 75 / 75 / 75 / 60%; "marigold-forty" found at every depth, "smoked cardamom" now started
# right but cut short ("The secret ingredient is smok."), "a copper heron" still not found.
SCHEDULES["bigram-rich"] = dict(SCHEDULES["bigram-more"], rich=0.5)
# "bigram-forms" (on the bigram-rich weights): half the facts in made-up relations, two more of
# their forms (the question names the role before the subject: "What mascot did the club choose?",
# answered from "... chose X as its mascot", which the fifth run's weights got 2-4 of 6 of at 512 tokens)
# and a quarter of word / phrase answers with an article in front. The sixth run (seed 5,
# 2 threads, 7.8 M tokens; 66 min beside the test suite): 87.5 / 87.5 / 85 / 65%; "a copper heron"
# now found to 2K; random facts of the "as its <role>" form 33 of 36 at 512 tokens (was 17), of the
# six older forms 47 of 48 (was 38). "smoked cardamom" still fails: "smoked c" right, then the
# two-token match lands on the prompt's "intelligent" ("The secret ingredient is smoked celligent").
SCHEDULES["bigram-forms"] = dict(SCHEDULES["bigram-rich"], generated=0.5, forms=8, articles=0.25)
# Two tries on the sixth run's weights (2026-11-24, not kept), probed on the 8 built-in needles x 5 depths
# at 512 / 1,024 / 2,048 / 4,096 / 8,192 tokens with 16 new tokens (see bigram-blend); the sixth run:
# 87.5 / 87.5 / 85 / 65 / 35%.
# "bigram-long" (seed 6, 2 threads, 1,500 steps, 6.1 M tokens, 48 min, 10 of them paused for benchmarks): the same
# episodes, but a last stage of 4,096-token sequences (haystacks of 1,024-3,900 tokens between needle
# and question), where every earlier run stopped at 2,048: flat in length, 75 / 75 / 75 / 75 / 65%
# (8K: 35 -> 65), but "a copper heron" (the "as its mascot" form) lost at every length ("The mascot
# is 8."). A 50/50 average of its weights and the shipped ones: 75 / 75 / 77.5 / 70 / 60%.
# Their stages: bigram-more's rows by sequence length and the 4,096-token one, each for the steps given.
_ROWS = {st[1]: st[1:] for st in SCHEDULES["bigram-more"]["stages"]}
_ROWS[4096] = (4096, 1, (1024, 3900), 0.1, 20000, 0.7, 0.0, 0.05, 0.6, 0.3, 0.3)


def _stages(*plan) -> list[tuple]:
    """[(steps, seq_len), ...] -> stages of those lengths' rows."""
    return [(steps, *_ROWS[seq_len]) for steps, seq_len in plan]


SCHEDULES["bigram-long"] = dict(SCHEDULES["bigram-forms"], stages=_stages((600, 1024), (500, 2048), (400, 4096)))
# "bigram-mix" (on the bigram-long weights; seed 7, 550 steps, 10 min): a short pass over every
# length, 512 tokens again first (bigram-long had none), to bring the heron back while 4K stays:
# 75 / 80 / 77.5 / 67.5 / 52.5%; the heron at 1-2K only (2 and 1 of 5 depths).
SCHEDULES["bigram-mix"] = dict(SCHEDULES["bigram-forms"], lr=3e-4, stages=_stages((200, 512), (200, 1024), (150, 4096)))
# "bigram-blend" (on the sixth run's weights, bigram-forms): bigram-forms' 512 and 1,024 stages and bigram-long's 4,096
# stage with their steps spread over the whole run (`blend`), so no length is trained last and forgotten.
# The seventh, shipped run (seed 8, 1 thread, 1,400 steps, 5.7 M tokens, 32 min beside other work).
# "smoked cardamom" is now found to 1K. Its reply, "The secret ingredient is smoked cardamom.", is 18
# tokens, so probes that stopped at 16 new tokens (`probe` did, until this run) scored it wrong; the
# harness generates 32. Earlier runs' probe figures may undercount it likewise; the shipped figures
# (the model card, hf_contextpar/assets/needle-lm/README.md) come from the harness.
SCHEDULES["bigram-blend"] = dict(
    SCHEDULES["bigram-forms"], blend=True, stages=_stages((600, 512), (400, 1024), (400, 4096))
)
# "bigram-blend2" (on the bigram-blend weights; tried, not kept): the same blend with 2,048-token sequences back in
# (bigram-blend had none, and 2K is where it fell), at half the learning rate. Seed 9, 1 thread, 1,400 steps,
# 33 min: 62.5 / 62.5 / 67.5 / 67.5 / 50% at 512 / 1,024 / 2,048 / 4,096 / 8,192 tokens (32 new tokens), worse
# at every length; its checkpoints at steps 500 and 900 no better (1K / 2K: 75 / 65 and 72.5 / 72.5%). "a
# copper heron" and "violet zeppelin" cut short ("a copper.", "a violet zeppel.") at every length.
SCHEDULES["bigram-blend2"] = dict(
    SCHEDULES["bigram-forms"], blend=True, lr=3e-4, stages=_stages((300, 512), (300, 1024), (500, 2048), (300, 4096))
)
# Checkpoint averages (tried 2026-11-25, not kept): the sixth and seventh runs' weights averaged element-wise
# (in fp64), probed the same way. 0.3 x sixth + 0.7 x seventh: 97.5 / 100 / 82.5 / 70 / 57.5% at 512 / 1,024 /
# 2,048 / 4,096 / 8,192 tokens (the seventh: 100 / 100 / 77.5 / 70 / 55); half and half: 95 / 82.5 / 67.5% at 1K /
# 2K / 4K. Two of 40 cases more at 2K and one at 8K, one fewer at 512: not worth new weights.


@torch.no_grad()
def init_copy_circuit(model, pairs: int = 4, gain: float = 2.85, bigram: bool = False):
    """Start layers 0-1 as an induction circuit (previous-token head + induction head); training refines it.

    Copying (find where the current token occurred before, copy what followed) is how every needle
    answer is produced, and learning that circuit from scratch is the long plateau of a short CPU
    run (see the module docstring). So:
    - one embedding dimension is a constant (0.05 for every token); layer 0's first query head and
      its KV head read it into the fastest RoPE pairs, the key rotated by one position, so the
      score is sum_j cos((t - s - 1) * theta_j): largest for the previous token (with layer 0's
      2-token window, `gain` sets by how much). Its value copies
      the token's content dims 1..32 into a "previous token" slot (dims 96..127).
    - layer 1's first head matches the current token's dims 1..16 against that slot on the slowest
      RoPE pairs (the match barely depends on distance) and writes the matched position's token
      back onto the content dims, where the tied unembedding reads it.
    - the rest of layers 0-1 starts with zero output projections, so the circuit is not buried in
      random-init noise.
    - `bigram` (layer 0 sees 3 tokens): layer 0's second query head (same KV head) peaks two
      tokens back and writes that token into a "token before the previous" slot (dims 64..95), and
      the induction head matches two tokens: current against previous (10 dims) plus previous
      against the one before it (6 dims). A one-token match continues a multi-token answer from
      the wrong place whenever the token just copied also occurs in the haystack ("mar" of
      "marigold" continued as "marred"); the two-token match keeps it on the needle.
    The constant column and layer 0's positional query/key rows are kept fixed (gradients zeroed:
    a try without that lost the previous-token pattern within 100 steps); everything else trains.
    The result is a stock checkpoint of the configured architecture: nothing here is needed to load
    or run it.
    """
    cfg = model.config
    d = cfg.head_dim
    for layer in model.model.layers[:2]:  # Qwen2's QKV biases start at zero (as HF initialises them)
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            if proj.bias is not None:
                proj.bias.zero_()
    theta = cfg.rope_parameters["rope_theta"]
    model.model.embed_tokens.weight[:, 0] = 0.05
    attn = model.model.layers[0].self_attn
    for j in range(pairs):
        angle = theta ** (-2 * j / d)
        attn.q_proj.weight[j, :] = 0.0
        attn.q_proj.weight[j + d // 2, :] = 0.0
        attn.k_proj.weight[j, :] = 0.0
        attn.k_proj.weight[j + d // 2, :] = 0.0
        attn.q_proj.weight[j, 0] = gain
        attn.k_proj.weight[j, 0] = gain * math.cos(angle)
        attn.k_proj.weight[j + d // 2, 0] = gain * math.sin(angle)
        if bigram:  # query head 1 (KV head 0 too), its query rotated back by one position: peaks at t - s = 2
            attn.q_proj.weight[d + j, :] = 0.0
            attn.q_proj.weight[d + j + d // 2, :] = 0.0
            attn.q_proj.weight[d + j, 0] = gain * math.cos(angle)
            attn.q_proj.weight[d + j + d // 2, 0] = -gain * math.sin(angle)
    # layer 0 head 0 also copies the token's content dims 1..32 into a "previous token" slot (dims 96..127)
    attn.v_proj.weight[:d] = 0.0
    attn.o_proj.weight[:, :d] = 0.0
    for k in range(d):
        attn.v_proj.weight[k, 1 + k] = 1.0
        attn.o_proj.weight[96 + k, k] = 0.03
    # layer 1 head 0: an induction head. Query = current token's dims 1..16, key = the previous-token
    # slot, on the slowest RoPE pairs (j = 8..15) so the match barely depends on distance; value =
    # the key token's content, written back onto the content dims, where the tied unembedding reads it.
    ind = model.model.layers[1].self_attn
    slow = list(range(d // 4, d // 2)) + list(range(d // 2 + d // 4, d))
    ind.q_proj.weight[:d] = 0.0
    ind.k_proj.weight[:d] = 0.0
    ind.v_proj.weight[:d] = 0.0
    ind.o_proj.weight[:, :d] = 0.0
    one = 10 if bigram else len(slow)
    for m, qd in enumerate(slow):
        if m < one:  # the current token against the key's previous token
            ind.q_proj.weight[qd, 1 + m] = 3.5
            ind.k_proj.weight[qd, 96 + m] = 3.5
        else:  # the previous token against the key's token before the previous
            ind.q_proj.weight[qd, 96 + m - one] = 3.5
            ind.k_proj.weight[qd, 64 + m - one] = 3.5
    for k in range(d):
        ind.v_proj.weight[k, 1 + k] = 1.0
        ind.o_proj.weight[1 + k, k] = 0.3
    # the rest of layers 0-1 writes nothing at first (zero output projections, learned from there),
    # so the circuit's signals are not buried under random-init noise
    for layer in model.model.layers[:2]:
        layer.self_attn.o_proj.weight[:, d:] = 0.0
        layer.mlp.down_proj.weight.zero_()
    if bigram:  # layer 0 head 1 writes the token two back into dims 64..95
        for k in range(d):
            attn.o_proj.weight[64 + k, d + k] = 0.03
    freeze_copy_circuit(model, pairs, bigram)


def freeze_copy_circuit(model, pairs: int = 4, bigram: bool = False):
    """Keep the constant embedding column and layer 0's positional query/key rows fixed (zeroed
    gradients); also when training goes on from a checkpoint (--init)."""
    d = model.config.head_dim
    attn = model.model.layers[0].self_attn
    rows = [j for j in range(pairs)] + [j + d // 2 for j in range(pairs)]
    q_rows = rows + [d + r for r in rows] if bigram else rows  # query head 1's too (its KV head is head 0's)

    def keeper(fixed):
        def keep_rows(grad):
            grad = grad.clone()
            grad[fixed] = 0
            return grad

        return keep_rows

    def keep_column(grad):
        grad = grad.clone()
        grad[:, 0] = 0
        return grad

    for proj, fixed in ((attn.q_proj, q_rows), (attn.k_proj, rows)):
        proj.weight.register_hook(keeper(fixed))
        if proj.bias is not None:  # Qwen2: the positional rows read the constant column only
            proj.bias.register_hook(keeper(fixed))
    model.model.embed_tokens.weight.register_hook(keep_column)


@torch.no_grad()
def probe(model, tok, lengths=(512, 1024), depths=(10, 50, 90), seed=0) -> dict:
    """Single-needle score (%) on the built-in needles, by length: the harness's own prompts and scoring."""
    from hf_contextpar.eval.needlebench import build_prompt, builtin_data, haystack_ids, score

    data = builtin_data()
    _, hay = haystack_ids(data, tok, max(lengths), seed)
    model.eval()
    out = {}
    for length in lengths:
        hits = []
        for n in data.needles:
            content = ([n["needle"]], n["retrieval_question"], [n["arg2"]])
            for d in depths:
                pr = build_prompt("single_retrieval", length, d, content, hay, tok)
                ids = torch.tensor([pr.ids])
                gen = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=32,  # as the harness: "... is smoked cardamom." is 18 tokens
                    do_sample=False,
                    pad_token_id=tok.pad_token_id,
                    eos_token_id=tok.eos_token_id,
                )
                hits.append(score("single_retrieval", tok.decode(gen[0, ids.shape[1] :]), pr.keywords))
        out[length] = round(sum(hits) / len(hits), 1)
    model.train()
    return out


def loss_on(model, batch, lm_share: float, lm_weight: float, gen: torch.Generator):
    ids, mark, pos = batch  # mark: 0 plain text (LM loss on a share), 1 answer / repeat, 2 no loss
    ans = mark == 1
    hidden = model.model(
        input_ids=ids[:, :-1], position_ids=pos[:, :-1], attention_mask=torch.ones_like(ids[:, :-1])
    ).last_hidden_state
    target = ids[:, 1:]
    is_ans = ans[:, 1:]
    lm = (mark[:, 1:] == 0) & (torch.rand(target.shape, generator=gen) < lm_share)
    h_ans, h_lm = hidden[is_ans], hidden[lm]
    logits_ans = model.lm_head(h_ans)
    l_ans = F.cross_entropy(logits_ans, target[is_ans])
    # a batch of repeats alone has no LM tokens: count it as 0 (the mean over nothing is NaN)
    l_lm = F.cross_entropy(model.lm_head(h_lm), target[lm]) if lm.any() else hidden.new_zeros(())
    with torch.no_grad():
        hit = (logits_ans.argmax(-1) == target[is_ans]).float()
        # an episode's answer is right when every answer token is: count via runs of answer positions
        flat_ans = is_ans.flatten().tolist()
        correct, total, cur, k = 0, 0, True, 0
        for i, a in enumerate(flat_ans):
            if a:
                cur = cur and bool(hit[k])
                k += 1
            if a and (i + 1 == len(flat_ans) or not flat_ans[i + 1]):
                correct += cur
                total += 1
                cur = True
    return l_ans + lm_weight * l_lm, l_ans.item(), l_lm.item(), hit.mean().item(), correct / max(total, 1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="model directory to write (config, weights, tokenizer)")
    p.add_argument("--work", default=None, help="checkpoints and log (default: needle-lm-train in the temp directory)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the schedule's)")
    p.add_argument("--scale-steps", type=float, default=1.0, help="multiply every stage's steps (a quick trial: 0.02)")
    p.add_argument("--schedule", choices=sorted(SCHEDULES), default="bigram", help="see SCHEDULES")
    p.add_argument("--init", help="start from this checkpoint (weights and tokenizer) instead of from scratch")
    p.add_argument("--warmup", type=int, default=None, help="learning-rate warm-up steps (default: the schedule's)")
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--probe-every", type=int, default=0, help="score the built-in needles every N steps (0: never)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the schedule's)")
    p.add_argument(
        "--copy-init",
        action="store_true",
        help="start layers 0-1 as an induction circuit (init_copy_circuit; tried, see its docstring)",
    )
    p.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="stop after this many steps of the same schedule (the learning rate still follows the full one)",
    )
    args = p.parse_args(argv)
    schedule = SCHEDULES[args.schedule]
    for name, default in (("lr", 3e-3), ("warmup", 60), ("threads", 1)):
        if getattr(args, name) is None:
            setattr(args, name, schedule.get(name, default))
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    work = args.work or os.path.join(tempfile.gettempdir(), "needle-lm-train")  # not next to OUT: package data
    os.makedirs(work, exist_ok=True)
    from transformers import AutoModelForCausalLM

    t0 = time.time()
    docs = training_documents()
    if args.init:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.init)
    else:
        tok = train_tokenizer(docs, args.vocab, schedule.get("window") is not None)
    corpus = Corpus(docs, tok)
    print(
        f"{len(docs)} documents, {sum(map(len, docs)) / 1e6:.2f} M chars, {corpus.tokens / 1e6:.2f} M tokens, "
        f"tokenizer {time.time() - t0:.0f}s",
        flush=True,
    )
    open_share = schedule.get("open_share", 0.0)
    episodes = Episodes(
        corpus,
        tok,
        frames=schedule.get("frames", 0.0),
        generated=schedule.get("generated", 0.0),
        open_share=open_share,
        words=open_vocabulary(docs) if open_share else None,
        rich=schedule.get("rich", 0.0),
        forms=schedule.get("forms", 6),
        articles=schedule.get("articles", 0.0),
    )
    config = make_config(len(tok), tok, schedule["size"], schedule.get("window"), schedule.get("theta", 5e5))
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if args.init:
        model = AutoModelForCausalLM.from_pretrained(args.init, attn_implementation="sdpa", dtype=torch.float32)
    if args.init and schedule.get("grow"):
        model = grow(model, schedule["grow"])
    if args.copy_init or (schedule.get("copy_init") and not args.init):
        init_copy_circuit(model, gain=schedule.get("gain", 2.85), bigram=schedule.get("bigram", False))
    elif schedule.get("copy_init"):
        freeze_copy_circuit(model, bigram=schedule.get("bigram", False))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters", flush=True)
    stages = [(max(1, round(st[0] * args.scale_steps)),) + tuple(st[1:]) for st in schedule["stages"]]
    total = sum(s[0] for s in stages)
    decay, no_decay = [], []
    for name, prm in model.named_parameters():
        fixed_parts = name in (
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.k_proj.weight",
        )
        (no_decay if prm.ndim < 2 or fixed_parts else decay).append(prm)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    warm = max(1, min(args.warmup, total // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))
    )
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    log = open(os.path.join(work, "train_log.jsonl"), "w")
    step, started, seen = 0, time.time(), 0
    history = []
    # the stages one after another, or, with `blend`, their steps spread evenly over the run (stage s's
    # i-th step at (i + 0.5) / steps_s of it), so every length is trained throughout
    order = [si for si, st in enumerate(stages) for _ in range(st[0])]
    if schedule.get("blend"):
        order = [si for _, si in sorted(((i + 0.5) / st[0], si) for si, st in enumerate(stages) for i in range(st[0]))]
    for si in order:
        steps, seq_len, batch, hay, multi, span, pose, copy, repeat, dense, rtext, lm_w = stages[si]
        rows = [
            pack(rng, episodes, seq_len + 1, hay, multi, span, pose, copy, repeat, dense, rtext, schedule["spread"])
            for _ in range(batch)
        ]
        b = tuple(torch.tensor([[int(x) for x in r[j]] for r in rows]) for j in range(3))
        model.train()
        loss, l_ans, l_lm, tok_acc, exact = loss_on(model, b, 0.25, lm_w, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        step += 1
        seen += batch * seq_len
        rec = dict(
            step=step,
            stage=si,
            ans_loss=round(l_ans, 4),
            lm_loss=round(l_lm, 4),
            ans_tok_acc=round(tok_acc, 3),
            ans_exact=round(exact, 3),
            lr=round(sched.get_last_lr()[0], 6),
            tokens=seen,
            elapsed=round(time.time() - started, 1),
        )
        history.append(rec)
        log.write(json.dumps(rec) + "\n")
        log.flush()
        if step % 10 == 0 or step == 1:
            recent = history[-10:]
            avg = lambda k: sum(r[k] for r in recent) / len(recent)  # noqa: E731
            print(
                f"step {step}/{total} stage {si} L={seq_len} ans_loss {avg('ans_loss'):.3f} lm_loss {avg('lm_loss'):.3f} "
                f"ans_tok_acc {avg('ans_tok_acc'):.3f} exact {avg('ans_exact'):.3f} "
                f"{seen / (time.time() - started):.0f} tok/s {time.time() - started:.0f}s",
                flush=True,
            )
        if step % args.ckpt_every == 0 or step == total:
            for ck in (os.path.join(work, "last"), os.path.join(work, f"step{step}")):
                model.save_pretrained(ck)
                tok.save_pretrained(ck)
        if args.probe_every and step % args.probe_every == 0:
            lengths = (512, 1024, 2048) if seq_len >= 1024 else (512, 1024)
            scores = probe(model, tok, lengths)
            log.write(json.dumps(dict(step=step, probe=scores)) + "\n")
            print(f"probe step {step}: single-needle score by length {scores}", flush=True)
        if step == args.max_steps:
            break
    model.eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    last = history[-20:]
    meta = dict(
        command="python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])),
        seed=args.seed,
        steps=step,
        schedule_steps=total,
        schedule=args.schedule,
        stages=[list(map(str, s)) for s in stages],
        parameters=n_params,
        tokens_seen=seen,
        wall_seconds=round(time.time() - t0),
        torch=torch.__version__,
        python=sys.version.split()[0],
        corpus_tokens=corpus.tokens,
        documents=len(docs),
        final_ans_exact=round(sum(r["ans_exact"] for r in last) / len(last), 3),
        final_lm_loss=round(sum(r["lm_loss"] for r in last) / len(last), 3),
    )
    if args.init and os.path.isfile(os.path.join(args.init, "training.json")):
        with open(os.path.join(args.init, "training.json")) as f:
            meta["init"] = json.load(f)  # the run these weights continue
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(json.dumps(meta), flush=True)


if __name__ == "__main__":
    main()
