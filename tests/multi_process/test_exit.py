"""Clean exit (issue 10, item 10): a patched model's script, the CLI and the tools exit 0 every time.

hf-contextpar tears down what it set up in an atexit hook (distributed.release_at_exit): before it,
the process group outlived the script (the runtime's Comm objects kept it, and the model <-> runtime
cycle is only collected during interpreter finalization), so gloo's threads were still alive while
the interpreter finalized, and now and then one rank aborted after printing its results.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from areas import ROOT  # the repository root
from launch import free_port, launch, worker_path


def test_user_script_without_cleanup_exits_cleanly():
    """Patch, generate with every strategy, return: exit 0, every async work waited, no gloo thread
    alive once the interpreter starts finalizing."""
    results = launch(2, [worker_path("exit_worker.py")], timeout=300, fresh=True)
    for rank, (rc, out, err) in enumerate(results):
        why = f"rank {rank} rc {rc}\nstdout:\n{out[-2000:]}\nstderr:\n{err[-3000:]}"
        assert rc == 0 and "generated" in out, why
        assert "terminate called" not in err, why
        assert "gloo threads at exit: []" in out, why
        assert "unwaited works: [] of" in out and "unwaited works: [] of 0" not in out, why


TOOLS = {
    # the model is made after the library initialised the group (transformers then imports
    # torch.distributed.nn.functional, whose defaults would hold the group: comm/group.py)
    "bench": ["-m", "hf_contextpar.bench", "--model", "tiny-llama", "--lengths", "64", "--repeats", "1",
              "--new-tokens", "3", "--strategies", "ring_pass_kv", "--peers", "none", "--no-plots"],
    "generate": ["-m", "hf_contextpar", "generate", "--prompt-tokens", "256", "--max-new-tokens", "2"],
    "eval": ["-m", "hf_contextpar.eval", "needlebench", "--lengths", "256", "--depths", "50",
             "--tasks", "single_retrieval"],
    # scripts whose own PartialState made the group, and which destroy it at the end
    "example": ["examples/generate.py"],
}  # fmt: skip


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_tools_leave_no_gloo_thread_to_finalization(tool, tmp_path):
    """Each tool (and an example) on 2 ranks: exit 0 and no gloo thread alive once the interpreter
    starts finalizing, which is what makes the rare abort after a clean run impossible."""
    args = TOOLS[tool]
    args = [args[1], *args[2:]] if args[0] == "-m" else [os.path.join(ROOT, args[0]), *args[1:]]
    if tool in ("bench", "eval"):
        args += ["--out", str(tmp_path)]
    results = launch(2, [worker_path("exit_check.py"), *args], timeout=300, fresh=True)
    for rank, (rc, out, err) in enumerate(results):
        why = f"{tool}: rank {rank} rc {rc}\nstdout:\n{out[-1500:]}\nstderr:\n{err[-3000:]}"
        assert rc == 0, why
        assert "gloo threads at exit: []" in err, why


def test_cli_exits_zero_every_time():
    """The README's job, three times at once (the contention makes teardown races likelier): exit 0 each."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    runs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                "2",
                f"--master_port={free_port()}",
                "-m",
                "hf_contextpar",
                "generate",
                "--prompt-tokens",
                "512",
                "--max-new-tokens",
                "2",
                "--baseline",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    for i, p in enumerate(runs):
        out, err = p.communicate(timeout=300)
        why = f"run {i}: rc {p.returncode}\nstdout:\n{out[-1500:]}\nstderr:\n{err[-3000:]}"
        assert p.returncode == 0 and "tokens identical: True" in out, why
        assert "terminate called" not in err, why


ORDERS = ("group", "model", "library")
RUNS = 4  # the race this catches failed 12 of 12 runs before its fix


def _launch_many(n_runs: int, args: list[str], at_once: int = 4):
    """`n_runs` launches of 2 ranks of tests/<args>, `at_once` at a time (contention makes teardown races
    likelier); every rank's (rc, stdout, stderr), run by run."""
    from concurrent.futures import ThreadPoolExecutor

    worker = [worker_path(args[0]), *args[1:]]
    with ThreadPoolExecutor(at_once) as pool:
        return list(pool.map(lambda _: launch(2, worker, timeout=600, fresh=True), range(n_runs)))


@pytest.mark.parametrize("order", ORDERS)
def test_every_script_order_exits_cleanly(order):
    """A user's script (exit_order_worker.py) that creates its group first, builds the model first, or
    imports hf-contextpar first, and ends with the README's one call, destroy_process_group: RUNS runs of 2
    ranks, every rank exits 0 and no gloo thread is alive once the interpreter starts finalizing. Group
    first failed the thread check in 12 of 12 runs before unbind_world_defaults (comm/group.py)."""
    for run, results in enumerate(_launch_many(RUNS, ["exit_order_worker.py", order])):
        for rank, (rc, out, err) in enumerate(results):
            why = f"{order} first, run {run}, rank {rank}: rc {rc}\nstdout:\n{out[-1500:]}\nstderr:\n{err[-3000:]}"
            assert rc == 0 and "generated" in out, why
            assert "terminate called" not in err, why
            assert "gloo threads at exit: []" in out, why


def test_the_users_call_is_needed():
    """Without the README's call the script's own group outlives every hook: its gloo threads are alive at
    finalization (what hf-contextpar cannot end for a group it did not create), so the check above can fail."""
    results = launch(2, [worker_path("exit_order_worker.py"), "group", "keep"], timeout=300, fresh=True)
    for rank, (rc, out, err) in enumerate(results):
        assert "generated" in out and "gloo threads at exit: [" in out, (
            f"rank {rank} rc {rc}\n{out[-1500:]}\n{err[-3000:]}"
        )
        assert "gloo threads at exit: []" not in out, f"rank {rank}: no gloo thread left without the call\n{out}"


def test_unbind_world_defaults():
    """torch.distributed.nn.functional imported after the group exists binds it as default arguments;
    unbind_world_defaults sets them back to None (the default group), which destroy_process_group then frees."""
    code = (
        "import os, weakref, torch.distributed as dist\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=os.environ['PORT'], RANK='0', WORLD_SIZE='1')\n"
        "dist.init_process_group('gloo')\n"
        "pg = weakref.ref(dist.group.WORLD)\n"
        "import torch.distributed.nn.functional as F\n"
        "assert F.all_gather.__defaults__ == (pg(),), F.all_gather.__defaults__\n"
        "from hf_contextpar.comm.group import unbind_world_defaults\n"
        "unbind_world_defaults()\n"
        "assert F.all_gather.__defaults__ == (None,) and F.broadcast.__defaults__ == (None,)\n"
        "dist.destroy_process_group()\n"
        "assert pg() is None, 'the group outlived destroy_process_group'\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PORT=str(free_port()), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
