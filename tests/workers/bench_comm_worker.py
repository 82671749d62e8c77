"""Two ranks: the exposed-communication clock in Comm (wait_s) and all_gather_start. Prints JSON."""

import json
import time

import torch
import torch.distributed as dist

from hf_contextpar.comm.collectives import Comm

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
comm = Comm(dist.group.WORLD, rank, world)
out = {}

# ring: rank 1 posts 0.3 s late, so rank 0's wait() is exposed for about that long and rank 1's is not
if rank == 1:
    time.sleep(0.3)
send = torch.full((1000,), float(rank))
got = comm.send_recv(send, (1000,)).wait()
out["ring_ok"] = bool((got == float((rank - 1) % world)).all())
out["ring_wait"] = comm.stats.waits["ring_shift"]

# all_gather_start: posted, work done meanwhile, then waited; equals the blocking all_gather
comm.stats.reset()
pending = comm.all_gather_start(torch.tensor([rank, 10 + rank]))
time.sleep(0.2)  # "the forward": the gather completes meanwhile, so the wait is short
t0 = time.perf_counter()
stacked = pending.wait()
out["async_wait_call_s"] = time.perf_counter() - t0
out["async_ok"] = stacked.tolist() == [[r, 10 + r] for r in range(world)]
out["async_stats"] = [comm.stats.bytes_sent, comm.stats.bytes_received, comm.stats.calls.get("all_gather", 0)]
out["async_wait"] = comm.stats.wait_s
print(json.dumps(out), flush=True)
dist.barrier()
dist.destroy_process_group()
