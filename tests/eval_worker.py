"""`python tests/eval_worker.py <eval args>`: the eval harness, optionally with a deliberately broken ring.

With HF_CONTEXTPAR_TEST_BREAK_RING=1 (read only here), ring pass-KV skips the attention of the
last K/V block to arrive, i.e. drops one ring step. The harness must then report "not
equivalent" and exit non-zero: this is the test that the harness can fail.
"""

from __future__ import annotations

import os
import sys

from hf_contextpar import attention
from hf_contextpar.kernels import attend
from hf_contextpar.merge import Accumulator


def ring_pass_kv_missing_last_step(step, q, kv_local, **attn):
    """hf_contextpar.attention.ring_pass_kv, except that the block of the last hop is never attended."""
    comm, rank, world = step.comm, step.comm.rank, step.comm.world
    acc = Accumulator()
    block, src = kv_local, rank
    for hop in range(world):
        pending = None
        if hop < world - 1:
            nxt = (rank - hop - 1) % world
            pending = comm.ring_shift(block, (step.kv_cols[nxt].numel(), *block.shape[1:]), block.dtype, block.device)
        if hop < world - 1 or world == 1:
            k, v = block[:, 0].permute(1, 2, 0, 3), block[:, 1].permute(1, 2, 0, 3)
            res = attend(q, k, v, step.q_cols, step.kv_cols[src], key_valid=step.key_valid(src), **attn)
            if res is not None:
                acc.add(*res)
        if pending is not None:
            block, src = pending.wait(), nxt
    return acc.out, acc.lse


if __name__ == "__main__":
    if os.environ.get("HF_CONTEXTPAR_TEST_BREAK_RING") == "1":
        attention.ALGORITHMS["ring_pass_kv"] = ring_pass_kv_missing_last_step
    from hf_contextpar.eval.cli import main

    sys.exit(main(sys.argv[1:]))
