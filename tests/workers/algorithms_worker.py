"""One rank of the simulator's fidelity check: the specification's plans (hf_contextpar.tools.selftest.spec) run with the real
`Comm` over gloo and on simulated ranks in this process; (out, LSE) must be bit-identical and the
byte and call counts equal. Writes OUT/rank{r}.json."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from records import write_records  # noqa: E402

from hf_contextpar.attention import algorithm  # noqa: E402
from hf_contextpar.attention.step import Step  # noqa: E402
from hf_contextpar.comm.collectives import Comm  # noqa: E402
from hf_contextpar.tools.selftest.simulated import run_algorithm, shard_inputs  # noqa: E402
from hf_contextpar.tools.selftest.spec import CASES, SCALE, layers_for, lengths, prepare, same  # noqa: E402


def counts(comm):
    """Bytes and calls, all operations and per tag."""
    return [
        [s.bytes_sent, s.bytes_received, dict(sorted(s.calls.items()))]
        for s in (comm.stats, comm.tagged["attention"], comm.tagged["control"])
    ]


def main():
    out_dir = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    comm = Comm(dist.group.WORLD, rank, n)
    records = []
    for case in CASES:
        try:
            plans, (q, k, v), _, window, softcap = prepare(case, n, lengths(case, n)[-1], "gqa", "all", torch.float64)
            for i, plan in enumerate(plans):
                qs, kvs = shard_inputs(plan, q, k, v, empty=1e3)
                attn = dict(scale=SCALE, window=window, softcap=softcap)
                sim_out, sims = run_algorithm(plan, qs, kvs, num_layers=layers_for(plan), **attn)
                for stats in (comm.stats, *comm.tagged.values()):
                    stats.reset()
                step = Step(plan, comm, None, layers_for(plan))
                real = []
                for layer in range(layers_for(plan)):
                    real.append(algorithm(plan.algorithm)(step.at(layer), qs[rank], kvs[rank], **attn))
                identical = all(same(a[0], b[0]) and same(a[1], b[1]) for a, b in zip(real, sim_out[rank]))
                records.append(
                    dict(
                        case=case.name,
                        plan=i,
                        algorithm=plan.algorithm,
                        identical=identical,
                        real=counts(comm),
                        sim=counts(sims[rank]),
                    )
                )
        except Exception as e:  # recorded, so one failure does not hide the others
            records.append(dict(case="error", job=case.name, error=f"{type(e).__name__}: {e}"))
    write_records(out_dir, records)


if __name__ == "__main__":
    main()
