"""A multi-turn conversation over the persistent sharded KV cache.

    torchrun --nproc_per_node 2 examples/multiturn_chat.py
    MODEL=Qwen/Qwen2.5-0.5B-Instruct torchrun --nproc_per_node 4 examples/multiturn_chat.py

The first turn is a long document (a full prefill, ring pass-KV); every later turn is a short
question over it: a partial prefill of T new tokens against P cached ones, where the planner
(strategy="auto", Meta Alg. 5) picks ring pass-KV or ring pass-Q per call. Each turn passes the
previous turn's past_key_values back in, as with any Hugging Face model.
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
else:  # built-in random-initialised model, works offline (its answers are noise, the mechanics are real)
    tok, model = byte_tokenizer(), tiny_model("llama_gqa8").to(state.device)

model = hf_contextpar.apply_context_parallel(model, strategy="auto")
runtime = hf_contextpar.get_runtime(model)
turns = [sample_text(8000), "\n\nQuestion: what does the with statement do?\nAnswer:",
         "\n\nQuestion: and what is a generator?\nAnswer:"]
ids = torch.empty(1, 0, dtype=torch.long, device=state.device)
cache = None
for i, text in enumerate(turns):
    new = tok(text, return_tensors="pt").input_ids.to(state.device)
    ids = torch.cat([ids, new], dim=1)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=24,
                             do_sample=False, return_dict_in_generate=True)
    cache, answer = out.past_key_values, out.sequences[:, ids.shape[1]:]
    ids = out.sequences
    if state.is_main_process:
        d = runtime.last_decision if runtime else None
        how = f"{d.strategy} (T={d.T}, P={d.P})" if d else "single process"
        print(f"turn {i}: {new.shape[1]} new tokens, prefill {how}, answer {tok.decode(answer[0])!r}")
if runtime and state.is_main_process:
    print(f"rank 0 caches {cache.local_length} of {cache.get_seq_length()} tokens per layer")
hf_contextpar.remove_context_parallel(model)
