"""A scripted multi-turn conversation over the persistent sharded KV cache (examples/chat.py is the interactive one).

    torchrun --nproc_per_node 2 examples/multiturn_chat.py
    MODEL=Qwen/Qwen2.5-0.5B-Instruct torchrun --nproc_per_node 4 examples/multiturn_chat.py

The first turn is a long document with two facts hidden in it (a full prefill); every later turn
is a short question over it: a partial prefill of T new tokens against P cached ones, where the
planner (strategy="auto", Meta Alg. 5) picks ring pass-KV or ring pass-Q per call. Each turn
passes the previous turn's cache back in (`past_key_values`, or `cache` from transformers 5.24 on),
as with any Hugging Face model. The default model is the built-in trained needle-lm (see its
model card, hf_contextpar/assets/needle-lm/README.md, for how often it finds the answer).
"""

import os

import torch
from accelerate import PartialState
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_contextpar
from hf_contextpar.cache import cache_argument, returned_cache
from hf_contextpar.models import builtin_model_path, sample_text

state = PartialState(cpu=not torch.cuda.is_available())  # initialises the process group (gloo on CPU)
path = os.environ.get("MODEL") or builtin_model_path("needle-lm")
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(state.device).eval()
model = hf_contextpar.apply_context_parallel(model, strategy="auto")
runtime = hf_contextpar.get_runtime(model)

text = sample_text(24_000)
a, b = text.index(". ", len(text) // 4) + 1, text.index(". ", 3 * len(text) // 4) + 1
document = (
    text[:a]
    + "\nThe lucky number of Captain Orsolo is 8125.\n"
    + text[a:b]
    + "\nThe old painting in the attic of Mirel Heights shows a golden walrus.\n"
    + text[b:]
)
turns = [
    "You are an intelligent AI assistant skilled in answering user questions.\n"
    "Please keep your answers concise and clear. Do not talk about irrelevant topics or repeat your answers.\n"
    f"The document given to you by the user is {document}\n\nNow, the question is: What is the lucky number of "
    "Captain Orsolo? Please answer in the format 'The lucky number is ______.'\n",
    "\n\nNow, the question is: What does the old painting in the attic of Mirel Heights show? "
    "Please answer in the format 'It shows ______.'\n",
]
ids = torch.empty(1, 0, dtype=torch.long, device=state.device)
cache = None
for i, text in enumerate(turns):
    new = tok(text, add_special_tokens=i == 0, return_tensors="pt").input_ids.to(state.device)
    ids = torch.cat([ids, new], dim=1)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            **{cache_argument(model): cache},  # `cache` from transformers 5.24 on
            max_new_tokens=24,
            do_sample=False,
            return_dict_in_generate=True,
        )
    cache, answer = returned_cache(out), out.sequences[:, ids.shape[1] :]
    ids = out.sequences
    if state.is_main_process:
        d = runtime.last_decision if runtime else None
        how = f"{d.strategy} (T={d.T}, P={d.P})" if d else "single process"
        print(
            f"turn {i}: {new.shape[1]} new tokens, prefill {how}, answer {tok.decode(answer[0], skip_special_tokens=True)!r}"
        )
if runtime and state.is_main_process:
    print(f"rank 0 caches {cache.local_length} of {cache.get_seq_length()} tokens per layer")
hf_contextpar.remove_context_parallel(model)
state.destroy_process_group()  # the group is ours (PartialState made it): tear it down before the interpreter does
