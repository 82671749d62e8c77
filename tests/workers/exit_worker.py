"""A minimal user script: patch a model, generate with every strategy, return without any cleanup.

Run as N ranks (tests/launch.py). Prints, from an atexit hook that runs after the library's own
(hooks run last-registered first), whether any async work was posted and never waited and which
gloo threads are still alive when the interpreter starts finalizing: none may be.
"""

import atexit
import glob

import torch.distributed as dist

posted = []  # [operation, waited] for every async work hf-contextpar posts


def _report():
    threads = sorted(open(p).read().strip() for p in glob.glob("/proc/self/task/*/comm"))
    print(f"gloo threads at exit: {[t for t in threads if 'gloo' in t]}", flush=True)
    print(f"unwaited works: {[op for op, waited in posted if not waited]} of {len(posted)}", flush=True)


atexit.register(_report)  # registered before hf-contextpar's hook, so it runs after it


class _Tracked:
    def __init__(self, work, op):
        self._work, self._entry = work, [op, False]
        posted.append(self._entry)

    def wait(self, *args):
        self._entry[1] = True
        return self._work.wait(*args)


def _track(owner, name, op):
    real = getattr(owner, name)

    def wrapper(*args, **kwargs):
        res = real(*args, **kwargs)
        if isinstance(res, list):
            return [_Tracked(w, op) for w in res]
        return _Tracked(res, op) if res is not None else None

    setattr(owner, name, wrapper)


from hf_contextpar.comm import collectives as comm  # noqa: E402

_track(dist, "batch_isend_irecv", "send/recv")
_track(dist, "broadcast", "broadcast")
_track(comm, "_all_gather_flat", "all_gather")

import hf_contextpar  # noqa: E402
from hf_contextpar.models import byte_tokenizer, sample_text, tiny_model  # noqa: E402

tok, model = byte_tokenizer(), tiny_model("mistral")  # sliding window, so every kernel path runs
tok.padding_side = "left"
inputs = tok([sample_text(200), sample_text(150)], return_tensors="pt", padding=True)
for strategy in ("ring_pass_kv", "ring_pass_q", "allgather_kv", "kv_runahead", "ulysses"):
    # the first call initialises the default group; a timeout on the next makes a group of hf-contextpar's own
    hf_contextpar.apply_context_parallel(model, strategy=strategy, timeout=120 if strategy == "ring_pass_q" else None)
    model.generate(**inputs, max_new_tokens=3, do_sample=False)  # batch 2 = N: batched pass-Q decode too
    if strategy != "ulysses":
        hf_contextpar.remove_context_parallel(model)
print("generated", flush=True)
# no remove_context_parallel, no destroy_process_group: the interpreter just exits
