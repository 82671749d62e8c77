"""Context-parallel generate() from a script: find a needle in a long document.

    torchrun --nproc_per_node 2 examples/generate.py
    accelerate launch --multi_gpu --num_processes 2 examples/generate.py   # also on CPU-only machines
    MODEL=Qwen/Qwen2.5-0.5B-Instruct torchrun --nproc_per_node 2 examples/generate.py

The built-in trained model (needle-lm, shipped inside the package) reads about 8,000 tokens of
English text with one fact hidden in the middle and answers a question about it, and says whether
the answer is right. The fact is one of NeedleBench's built-in needles, the one needle-lm finds at
every depth to 8K; its model card (hf_contextpar/assets/needle-lm/README.md) says how often it finds the others (an invented "night
ferry leaves from pier 4096" it got wrong at 4K and 8K). Every rank runs the same code with the
same prompt; all get the same tokens, each caching only its share.
"""

import os

import torch
from accelerate import PartialState
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_contextpar
from hf_contextpar.cache import returned_cache
from hf_contextpar.models import builtin_model_path, sample_text

state = PartialState(cpu=not torch.cuda.is_available())  # initialises the process group (gloo on CPU)
path = os.environ.get("MODEL") or builtin_model_path("needle-lm")  # a standard HF model directory
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(state.device).eval()

# A long document with one fact in it, then NeedleBench's question (the form needle-lm was trained on).
text = sample_text(30_000)
middle = text.index(". ", len(text) // 2) + 1
needle = "The lighthouse keeper of Velmora Point paints the number 7341 on every lantern she repairs."
document = text[:middle] + "\n" + needle + "\n" + text[middle:]
prompt = (
    "You are an intelligent AI assistant skilled in answering user questions.\n"
    "Please keep your answers concise and clear. Do not talk about irrelevant topics or repeat your answers.\n"
    f"The document given to you by the user is {document}\n\nNow, the question is: What number does the lighthouse "
    "keeper of Velmora Point paint on every lantern she repairs? Please answer in the format 'The number is ______.'\n"
)

model = hf_contextpar.apply_context_parallel(model)
inputs = tok(prompt, return_tensors="pt").to(state.device)
with torch.no_grad():
    out = model.generate(**inputs, max_new_tokens=24, do_sample=False, return_dict_in_generate=True)
cache = returned_cache(out)
print(
    f"rank {state.process_index}/{state.num_processes}: prompt {inputs.input_ids.shape[1]} tokens, "
    f"this rank caches {getattr(cache, 'local_length', cache.get_seq_length())} of them per layer"
)
if state.is_main_process:
    answer = tok.decode(out.sequences[0, inputs.input_ids.shape[1] :], skip_special_tokens=True)
    print("answer:", answer, "(right)" if "7341" in answer else "(wrong: the needle says 7341)")
hf_contextpar.remove_context_parallel(model)
state.destroy_process_group()  # the group is ours (PartialState made it): tear it down before the interpreter does
