"""Start N processes of a script the way torchrun does (RANK, WORLD_SIZE, MASTER_*), on CPU/gloo."""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(n: int, args: list[str], timeout: float = 600, env: dict | None = None):
    """Run `python args...` as n ranks; returns a list of CompletedProcess-like (returncode, stdout, stderr)."""
    port = free_port()
    procs = []
    for rank in range(n):
        e = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(n),
            LOCAL_WORLD_SIZE=str(n),
            OMP_NUM_THREADS="1",
            TOKENIZERS_PARALLELISM="false",
            HF_HUB_OFFLINE="1",
            **(env or {}),
        )
        procs.append(
            subprocess.Popen([sys.executable, *args], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, err = p.communicate()
            err += f"\n[launcher] killed after {timeout}s"
        results.append((p.returncode, out, err))
    return results


_matrices: dict = {}


def tolerance(model_type: str, dtype: str, kernel_swap: float | None = None) -> float:
    """Max |logit diff| against the unpatched single process: the exactness oracle's for the family's
    model type and the dtype's name (bf16/fp16: the kernel-swap bound, from the measured kernel swap)."""
    from hf_contextpar.eval.oracle import logit_tolerance

    return logit_tolerance(model_type, dtype, kernel_swap)


def matrix(worker: str, n: int, tmp_path_factory, args: tuple[str, ...] = ()) -> list[list[dict]]:
    """Every rank's records from `tests/<worker> OUT *args` on n ranks, launched once per session and
    (worker, n, args)."""
    key = (worker, n, tuple(args))
    if key not in _matrices:
        path = os.path.join(os.path.dirname(__file__), worker)
        _matrices[key] = run_matrix(n, path, tmp_path_factory.mktemp(f"{worker[:-3]}{n}"), args)
    return _matrices[key]


def selected(request, key: str, everything) -> tuple:
    """The worker's arguments for the values of parameter `key` that this session runs for the requesting
    test function at the same N (after -k, -m and the rotation, tests/conftest.py): () when that is all of
    `everything`, else the comma-separated subset in its order, so a matrix launch runs only those."""
    test, n = request.node.originalname, request.node.callspec.params["n"]
    wanted = {
        item.callspec.params[key]
        for item in request.session.items
        if getattr(item, "originalname", None) == test and item.callspec.params.get("n") == n
    }
    subset = [v for v in everything if v in wanted]
    return () if len(subset) == len(everything) else (",".join(subset),)


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


def run_matrix(n: int, worker: str, out_dir, args: tuple[str, ...] = ()) -> list[list[dict]]:
    """Launch `worker OUT *args` on n ranks and return every rank's OUT/rank{r}.json records."""
    import json

    procs = launch(n, [worker, str(out_dir), *args], timeout=1200)
    for rank, (rc, _, err) in enumerate(procs):
        assert rc == 0, f"rank {rank} exited {rc}:\n{err[-4000:]}"
    return [json.load(open(os.path.join(str(out_dir), f"rank{r}.json"))) for r in range(n)]
