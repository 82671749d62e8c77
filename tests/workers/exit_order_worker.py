"""A user's script in one of three orders (issue 31, item 3): ORDER [keep].

    group    the script creates the process group, then imports transformers and hf-contextpar and builds the model
    model    it builds the model with transformers, then creates the group, then imports hf-contextpar
    library  it imports hf-contextpar first, then creates the group, then builds the model

Then, in every order: apply_context_parallel, one greedy generate(), and the README's one call,
`dist.destroy_process_group()` (the group is the script's own); `keep` leaves that call out.
Prints, from an atexit hook that runs after every other (registered first, hooks run last-registered
first), which gloo threads are still alive when the interpreter starts finalizing: none may be.
Run as N ranks (tests/launch.py); plain transformers and torch, the built-in model's directory.
"""

import atexit
import glob
import os
import sys


def _thread_name(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except (FileNotFoundError, ProcessLookupError):  # the thread exited meanwhile
        return ""


def _report():
    threads = sorted(_thread_name(p) for p in glob.glob("/proc/self/task/*/comm"))
    print(f"gloo threads at exit: {[t for t in threads if 'gloo' in t]}", flush=True)


atexit.register(_report)
order, keep = sys.argv[1], sys.argv[2:] == ["keep"]
assert order in ("group", "model", "library"), order
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
PATH = os.path.join(ROOT, "hf_contextpar", "assets", "needle-lm")

if order == "library":
    import hf_contextpar

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

torch.set_num_threads(1)
if order == "group":
    dist.init_process_group("gloo")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

tok = AutoTokenizer.from_pretrained(PATH)
model = AutoModelForCausalLM.from_pretrained(PATH, dtype=torch.float32).eval()
if order == "model":
    dist.init_process_group("gloo")

import hf_contextpar  # noqa: E402

hf_contextpar.apply_context_parallel(model)
inputs = tok(
    "The lighthouse keeper of Velmora Point paints the number 7341 on every lantern. " * 8, return_tensors="pt"
)
out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
print(f"generated {out[0, inputs.input_ids.shape[1] :].tolist()}", flush=True)
if not keep:
    dist.destroy_process_group()  # the group is the script's own: the README's one call
