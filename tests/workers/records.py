"""What a worker script (tests/workers/*.py, run as a rank by tests/launch.py) records for its test: every rank
writes its records to OUT/rank{r}.json, then the ranks take the process group down together."""

from __future__ import annotations

import os


def tolerance(model_type: str, dtype: str, kernel_swap: float | None = None) -> float:
    """Max |logit diff| against the unpatched single process: the exactness oracle's for the family's
    model type and the dtype's name (bf16/fp16: the kernel-swap bound, from the measured kernel swap)."""
    from hf_contextpar.eval.oracle import logit_tolerance

    return logit_tolerance(model_type, dtype, kernel_swap)


def record_each(out_dir, names, key: str, check):
    """A matrix worker's loop over families or geometries: `check(name, rec)` for every name, recording any
    number of cases per name (`run_cases` takes one per case), each failure as a case "error" so one broken
    entry does not hide the others; then OUT/rank{r}.json."""
    import traceback

    import torch.distributed as dist

    n = dist.get_world_size()
    records = []
    for name in names:
        try:
            check(name, lambda case, name=name, **kw: records.append({key: name, "n": n, "case": case, **kw}))
        except Exception as e:
            records.append({key: name, "n": n, "case": "error", "error": f"{e}\n{traceback.format_exc()}"})
    write_records(out_dir, records)


def write_records(out_dir, records: list[dict]):
    """A matrix worker's last step: OUT/rank{r}.json, then the process group is taken down together."""
    import json

    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(os.path.join(str(out_dir), f"rank{rank}.json"), "w") as f:
        json.dump(records, f, indent=1)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run_cases(cases):
    """A case-matrix worker's main: every (name, check) of cases(N) in order on every rank, then write_records.

    A check that raises is recorded, not fatal: the other ranks raise the same way (same plan, same inputs).
    """
    import sys
    import traceback

    import torch
    import torch.distributed as dist

    import hf_contextpar
    from hf_contextpar.models import tiny_model

    torch.set_num_threads(1)
    hf_contextpar.apply_context_parallel(tiny_model("llama"))  # initialises the process group from the env
    records = []
    for name, check in cases(dist.get_world_size()):
        try:
            records.append(dict(case=name, **check()))
        except Exception as e:
            records.append(
                dict(case=name, ok=False, error=f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
            )
    write_records(sys.argv[1], records)
