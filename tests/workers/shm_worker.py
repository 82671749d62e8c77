"""One rank of a shared-memory all-gather scenario; prints 'RESULT <text>' lines test_shm reads."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import hf_contextpar
from hf_contextpar.comm.collectives import Comm
from hf_contextpar.comm.shm import SLOT_BYTES, open_shm_gather
from hf_contextpar.models import tiny_model


def gather(comm: Comm, rank: int, world: int) -> str:
    """Hundreds of gathers of every size and dtype the decode path sends, each checked against gloo's."""
    g = torch.Generator().manual_seed(1234 + rank)
    shm = comm.shm
    sizes = [0, 1, 7, 129, 4096, 33 * 1000, SLOT_BYTES // 4, SLOT_BYTES // 4 + 1]  # the last one goes over gloo
    for i in range(300):
        dtype = (torch.float32, torch.bfloat16, torch.float64, torch.long)[i % 4]
        n = (
            sizes[i % len(sizes)]
            if i < 40
            else int(torch.randint(0, 3000, (1,), generator=torch.Generator().manual_seed(i)))
        )
        n = min(n, SLOT_BYTES // torch.empty(0, dtype=dtype).element_size() + 1)
        t = (torch.randn(n, generator=g) * 100).to(dtype)
        comm.shm = shm
        via_shm = comm.all_gather(t.view(-1, 1) if n else t)
        comm.shm = None
        via_gloo = comm.all_gather(t.view(-1, 1) if n else t)
        if not torch.equal(via_shm, via_gloo):
            return f"gather {i} (n={n}, {dtype}) differs from gloo's"
        if not torch.equal(via_shm[rank].view(-1), t):
            return f"gather {i}: own part changed"
    comm.shm = shm
    for data in (torch.arange(5.0) + rank, torch.zeros(0)):  # the input check rides on the next gather
        seen, before = [], shm._k
        comm.check_before_next(torch.tensor([rank, 7]), seen.append)
        got = comm.all_gather(data)
        if shm._k != before + 1 or [s.tolist() for s in seen] != [[[r, 7] for r in range(world)]]:
            return f"the fingerprint did not ride on the gather ({shm._k - before} gathers, saw {seen})"
        if not torch.equal(got, torch.stack([data - rank + r for r in range(world)])):
            return "a gather carrying the fingerprint returned the wrong stack"
    seen = []
    comm.check_before_next(torch.tensor([rank, 7]), seen.append)
    comm.run_check()  # no gather came: gathered on its own
    if [s.tolist() for s in seen] != [[[r, 7] for r in range(world)]]:
        return "the fingerprint gathered on its own gave the wrong stack"
    return "ok"


def main():
    scenario = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if scenario == "off" and rank == 1:
        os.environ["HF_CONTEXTPAR_SHM"] = "0"  # on this rank only
    if scenario == "full" and rank == 0:  # /dev/shm has no room: the reservation fails

        def no_room(fd, offset, length):
            raise OSError(28, "No space left on device")

        os.posix_fallocate = no_room
    if scenario in ("gather", "sizes", "off", "full"):
        dist.init_process_group("gloo")
        group = dist.group.WORLD
        comm = Comm(group, rank, world)
        comm.shm = open_shm_gather(group, rank, world, torch.device("cpu"), 60)
        print(f"RESULT shm {comm.shm is not None}", flush=True)
        if scenario == "gather":
            print(f"RESULT {gather(comm, rank, world)}", flush=True)
        elif scenario == "sizes":
            try:
                comm.all_gather(torch.zeros(3 + rank))
                print("RESULT no error", flush=True)
            except hf_contextpar.ContextParallelError as e:
                print(f"RESULT ContextParallelError {e}", flush=True)
                os._exit(0)  # the ranks' gloo state is unusable after mismatched collectives; do not tear down
        comm.close_shm()
        dist.destroy_process_group()
    elif scenario == "model":  # apply_context_parallel opens it and remove_context_parallel closes it
        model = hf_contextpar.apply_context_parallel(tiny_model("llama"))
        runtime = hf_contextpar.get_runtime(model)
        shm = runtime.comm.shm
        print(f"RESULT shm {shm is not None}", flush=True)
        ids = torch.randint(0, 256, (1, 23), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=6, do_sample=False)
        print(f"RESULT shm gathers {runtime.comm.shm._k if shm is not None else 0}", flush=True)
        hf_contextpar.remove_context_parallel(model)
        print(f"RESULT closed {shm is not None and shm._head is None}", flush=True)
        print(f"RESULT tokens {out[0].tolist()}", flush=True)


if __name__ == "__main__":
    main()
