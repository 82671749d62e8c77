"""Interactive chat over a long document, context parallel, with a persistent sharded KV cache.

    torchrun --nproc_per_node 2 examples/chat.py
    torchrun --nproc_per_node 2 examples/chat.py --document report.txt --model path/to/hf-model
    printf 'What is the pass key?\n' | torchrun --nproc_per_node 2 examples/chat.py   # scripted

The document is prefilled once (sharded over the ranks); each question is a short partial prefill
over the cached document plus the earlier turns, and the answer streams on rank 0 as it is
decoded. Rank 0 reads the questions from standard input and broadcasts each one to every rank
(they all have to run the same forward), so the other ranks never touch a terminal. An empty
line or end of input ends the chat.

With the built-in needle-lm the default document is English text shipped with Python with a few
invented facts hidden in it; it was trained on NeedleBench-style questions (its model card,
hf_contextpar/assets/needle-lm/README.md, says how often it finds the answer yet), so ask about those facts and add the answer format, e.g. "What is the pass key? Please answer in the format
'The pass key is ______.'" (a question without a format gets one appended).
"""

import argparse
import sys

import torch
import torch.distributed as dist
from accelerate import PartialState
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

import hf_contextpar
from hf_contextpar.cache import cache_argument, returned_cache
from hf_contextpar.models import builtin_model_path, sample_text

FACTS = [
    "The pass key is 52907. Remember it. 52907 is the pass key.",
    "The harbour master of Tolvik Bay keeps the spare oars inside a green barrel.",
    "The choir of Saint Amberly Abbey always rehearses in room 318.",
]
QUESTIONS = [
    "What is the pass key? Please answer in the format 'The pass key is ______.'",
    "Where does the harbour master of Tolvik Bay keep the spare oars? "
    "Please answer in the format 'The spare oars are inside ______.'",
    "In which room does the choir of Saint Amberly Abbey rehearse? "
    "Please answer in the format 'It rehearses in room ______.'",
]


def default_document(chars: int) -> str:
    """pydoc text with FACTS at 20%, 50% and 80% of it, each at a sentence boundary."""
    text = sample_text(chars)
    pieces, last = [], 0
    for fact, where in zip(FACTS, (0.2, 0.5, 0.8)):
        cut = text.index(". ", int(len(text) * where)) + 1
        pieces += [text[last:cut], "\n" + fact + "\n"]
        last = cut
    return "".join(pieces + [text[last:]])


def ask(state) -> str | None:
    """Rank 0 reads a line; every rank gets it (None ends the chat)."""
    box = [None]
    if state.is_main_process:
        try:
            line = input("\nquestion> ").strip()
        except EOFError:
            line = ""
        if line:
            if not sys.stdin.isatty():
                print(line)
            box = [
                line if "format" in line else line.rstrip("?") + "? Please answer in the format 'The answer is ______.'"
            ]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default=builtin_model_path("needle-lm"), help="HF model directory or hub id (default needle-lm)"
    )
    p.add_argument("--document", help="a UTF-8 text file (default: Python's pydoc text with three facts hidden in it)")
    p.add_argument(
        "--chars",
        type=int,
        default=4_000,
        help="characters of the default document (about 4 per token; needle-lm retrieves to ~1K tokens)",
    )
    p.add_argument("--max-new-tokens", type=int, default=48)
    args = p.parse_args()
    state = PartialState(cpu=not torch.cuda.is_available())  # the process group (gloo on CPU)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(state.device).eval()
    model = hf_contextpar.apply_context_parallel(model)
    runtime = hf_contextpar.get_runtime(model)
    document = open(args.document, encoding="utf-8").read() if args.document else default_document(args.chars)
    # NeedleBench's English template, the form needle-lm was trained on; later turns append to it.
    head = (
        "You are an intelligent AI assistant skilled in answering user questions.\n"
        "Please keep your answers concise and clear. Do not talk about irrelevant topics or repeat your answers.\n"
        f"The document given to you by the user is {document}"
    )
    ids = tok(head, return_tensors="pt").input_ids.to(state.device)
    streamer = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True) if state.is_main_process else None
    if state.is_main_process:
        print(f"document: {ids.shape[1]} tokens over {state.num_processes} process(es)")
        if not args.document:
            print("hidden in it:\n  " + "\n  ".join(FACTS) + "\ntry:\n  " + "\n  ".join(QUESTIONS))
    cache = None
    while (question := ask(state)) is not None:
        new = tok(f"\n\nNow, the question is: {question}\n", add_special_tokens=False, return_tensors="pt").input_ids
        ids = torch.cat([ids, new.to(state.device)], dim=1)
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                **{cache_argument(model): cache},  # `cache` from transformers 5.24 on
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                streamer=streamer,
                return_dict_in_generate=True,
            )
        cache, ids = returned_cache(out), out.sequences
        if state.is_main_process and runtime is not None:
            d = runtime.last_decision
            how = f"prefill {d.strategy} (T={d.T}, P={d.P}); " if d else ""
            print(f"  [{how}rank 0 caches {cache.local_length} of {cache.get_seq_length()} tokens per layer]")
    hf_contextpar.remove_context_parallel(model)
    state.destroy_process_group()  # the group is ours (PartialState made it): tear it down before the interpreter does


if __name__ == "__main__":
    main()
