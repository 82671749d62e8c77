"""Data-parallel replicas x context parallelism (issue 59): the layout of accelerate's `ParallelismConfig` (its
environment, or a tool's `cp_size`), checked and turned into one CP group per replica. In process: the layout's
arithmetic and its refusals; launched (4 processes): `apply_context_parallel(model)` under the environment puts
each rank in its replica's CP group of 2, each replica exact on its own prompt. lm-eval over replicas is
tests/*/test_lmeval.py's.

This file holds the checks that launch ranks (tests/launch.py); the others, and the feature's whole description, are in
tests/unit/test_replicas.py.
"""

from __future__ import annotations

import os

from launch import torchrun, worker_path


def test_apply_makes_a_cp_group_per_replica():
    env = dict(os.environ, PARALLELISM_CONFIG_DP_REPLICATE_SIZE="2", PARALLELISM_CONFIG_CP_SIZE="2")
    done = torchrun(4, [worker_path("replicas_worker.py")], timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("RANK"))
    assert lines == [f"RANK {r} replica {r // 2} cp_world 2 exact" for r in range(4)], done.stdout[-3000:]
