"""One rank of the real-checkpoint geometry matrix (issue 11): for every geometry in
tests/workers/geometries.py, prefill logits at prompt lengths on both sides of its windows and position
thresholds, and a short greedy generation that crosses them, against the unpatched
single-process model. Writes OUT/rank{r}.json."""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
from cp_worker import gathered_equal, prompt  # noqa: E402
from geometries import GEOMETRIES, GEOMETRY_THRESHOLD, geometry_model, geometry_model_type  # noqa: E402
from hf_contextpar.eval import first_divergence, logits_diff  # noqa: E402
from hf_contextpar.eval.oracle import FLOAT_TOL, Fp64Internals  # noqa: E402
from hf_contextpar.patches.verified import VERIFIED  # noqa: E402
from records import record_each  # noqa: E402
from shared_reference import OnRankZero

import hf_contextpar  # noqa: E402

FP64 = FLOAT_TOL[torch.float64]


def lengths_for(name: str) -> list[int]:
    """Prefill lengths: below every window and threshold; just past the largest (so that the middle
    ranks' head-tail shards lie wholly below it, as with a position-dependent RoPE's switch); and
    past twice it."""
    t = GEOMETRY_THRESHOLD.get(name, 24)
    return [17, t + 5, 2 * t + 5]


def fp32_internals(name: str) -> bool:
    """Does the family compute parts in fp32 on purpose (its census bound is wider than fp64's)? Its fp64 run then
    makes them fp64 too (`Fp64Internals`, the census's fp32-internals route) and is held to fp64's bound."""
    return VERIFIED.get(geometry_model_type(name), (FP64,))[0] > FP64


@torch.no_grad()
def check(name: str, n: int, rec):
    for dtype in (torch.float64, torch.float32):
        dname = str(dtype).split(".")[-1]
        internals = dtype == torch.float64 and fp32_internals(name)
        ref = OnRankZero(geometry_model(name, dtype=dtype))
        cp = hf_contextpar.apply_context_parallel(geometry_model(name, dtype=dtype), timeout=120)
        with Fp64Internals() if internals else contextlib.nullcontext():
            for length in lengths_for(name):
                ids = prompt(length, seed=length)
                d = logits_diff(cp(ids).logits, ref(ids).logits)
                rec("prefill_logits", dtype=dname, fp64_internals=internals, length=length, max_diff=d)
        if dtype == torch.float64:
            # greedy from a prompt ending 4 tokens before the threshold: decode crosses it
            ids = prompt(GEOMETRY_THRESHOLD.get(name, 44) - 4, seed=3)
            kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
            a, b = ref.generate(ids, **kw), cp.generate(ids, **kw)
            rec(
                "greedy",
                dtype=dname,
                length=ids.shape[1],
                tokens_equal=torch.equal(a, b),
                diverge=first_divergence(a, b),
                ranks_agree=gathered_equal(b),
            )


def main():
    out_dir = sys.argv[1]
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(GEOMETRIES)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    record_each(out_dir, names, "geometry", lambda name, rec: check(name, dist.get_world_size(), rec))


if __name__ == "__main__":
    main()
