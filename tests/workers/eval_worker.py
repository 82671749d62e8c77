"""`python tests/workers/eval_worker.py <eval args>`: the eval harness, optionally with a deliberately broken ring.

With HF_CONTEXTPAR_TEST_BREAK_RING=1 (read only here), ring pass-KV never attends the K/V block
of its last hop, i.e. drops one ring step. The harness must then report "not equivalent" and exit
non-zero: this is the test that the harness can fail.
"""

from __future__ import annotations

import importlib
import itertools
import os
import sys

ring = importlib.import_module(
    "hf_contextpar.attention.ring_pass_kv"
)  # the module: the package re-exports the function


def drop_last_hop(attend, world: int):
    """`attend` as ring pass-KV calls it (once per hop, `world` hops per layer), minus every last hop."""
    calls = itertools.count()

    def attend_but_last(*args, **kwargs):
        return None if next(calls) % world == world - 1 else attend(*args, **kwargs)

    return attend_but_last


if __name__ == "__main__":
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if os.environ.get("HF_CONTEXTPAR_TEST_BREAK_RING") == "1" and world > 1:
        ring.attend = drop_last_hop(ring.attend, world)
    from hf_contextpar.eval.cli import main

    sys.exit(main(sys.argv[1:]))
