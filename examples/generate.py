"""Context-parallel generate() from a script.

    torchrun --nproc_per_node 2 examples/generate.py
    accelerate launch --multi_gpu --num_processes 2 examples/generate.py   # also on CPU-only machines
    MODEL=Qwen/Qwen2.5-0.5B-Instruct torchrun --nproc_per_node 2 examples/generate.py

Every rank runs the same code with the same prompt; all get the same tokens.
"""

import os

import torch
from accelerate import PartialState

import hf_contextpar
from hf_contextpar.models import byte_tokenizer, sample_text, tiny_model

state = PartialState(cpu=not torch.cuda.is_available())  # initialises the process group (gloo on CPU)
name = os.environ.get("MODEL")
if name:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(name)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16).to(state.device).eval()
else:  # built-in random-initialised model, works offline
    tok, model = byte_tokenizer(), tiny_model("llama").to(state.device)

model = hf_contextpar.apply_context_parallel(model)
inputs = tok(sample_text(6000), return_tensors="pt").to(state.device)
with torch.no_grad():
    out = model.generate(**inputs, max_new_tokens=32, do_sample=False, return_dict_in_generate=True)
cache = out.past_key_values
print(f"rank {state.process_index}/{state.num_processes}: prompt {inputs.input_ids.shape[1]} tokens, "
      f"this rank caches {getattr(cache, 'local_length', cache.get_seq_length())} of them per layer")
if state.is_main_process:
    print(repr(tok.decode(out.sequences[0, inputs.input_ids.shape[1]:])))
hf_contextpar.remove_context_parallel(model)
