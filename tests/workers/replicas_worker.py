"""One rank of a launch split into replicas x CP by accelerate's parallelism config (issue 59): the layout comes
from the PARALLELISM_CONFIG_* environment the test sets, `apply_context_parallel(model)` takes no group, and each
replica generates its own prompt over its own CP group, exact against the unpatched model on one process.
Prints one line per rank: `RANK r replica q cp_world w exact`."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

import hf_contextpar
from hf_contextpar.comm.replicas import Replicas
from hf_contextpar.models import tiny_model

warnings.filterwarnings("ignore")


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cp = int(os.environ["PARALLELISM_CONFIG_CP_SIZE"])
    replica = Replicas.of(world, cp).coordinates(rank)[0]
    model = tiny_model("llama", dtype=torch.float64)
    reference = tiny_model("llama", dtype=torch.float64)
    ids = torch.randint(0, 256, (1, 29 + 4 * replica), generator=torch.Generator().manual_seed(replica))
    with torch.no_grad():
        want = reference.generate(ids, max_new_tokens=6, do_sample=False)
        want_logits = reference(ids).logits
    hf_contextpar.apply_context_parallel(model)
    runtime = hf_contextpar.get_runtime(model)
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=6, do_sample=False)
        got_logits = model(ids).logits
    exact = torch.equal(got, want) and (got_logits - want_logits).abs().max().item() < 1e-10
    print(f"RANK {rank} replica {replica} cp_world {runtime.world} {'exact' if exact else 'DIFFERS'}", flush=True)
    hf_contextpar.remove_context_parallel(model)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
