"""The shared-memory all-gather that CPU ranks on one host use for decode (hf_contextpar/comm/shm.py)."""

from __future__ import annotations

import os

import pytest
import torch
from launch import launch, worker_path

from hf_contextpar.models import tiny_model

WORKER = worker_path("shm_worker.py")


def _results(procs):
    return [[line[7:] for line in out.splitlines() if line.startswith("RESULT ")] for _, out, _ in procs]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_gathers_equal_gloo(world):
    """Every size (empty, odd, at the slot limit, over it: gloo) and dtype gives gloo's stack exactly."""
    procs = launch(world, [WORKER, "gather"], timeout=300)
    for rank, lines in enumerate(_results(procs)):
        assert lines == ["shm True", "ok"], (rank, lines, procs[rank][2][-2000:])


def test_mismatched_sizes_fail_on_every_rank():
    """Ranks gathering different sizes (different collectives) get a clear error, not a wrong stack."""
    procs = launch(2, [WORKER, "sizes"], timeout=120)
    for rank, lines in enumerate(_results(procs)):
        assert lines[-1].startswith("ContextParallelError") and "sizes differ" in lines[-1], (rank, lines)


def test_switched_off_on_one_rank_is_off_for_all():
    """HF_CONTEXTPAR_SHM=0 on rank 1 only: every rank agrees to use gloo."""
    procs = launch(2, [WORKER, "off"], timeout=120)
    for rank, lines in enumerate(_results(procs)):
        assert lines == ["shm False"], (rank, lines, procs[rank][2][-2000:])


def test_no_room_in_dev_shm_falls_back_to_gloo_on_every_rank():
    """The file's pages are reserved up front: a full /dev/shm fails there (not with SIGBUS at a
    later write), every rank uses gloo, and the file is gone."""
    before = set(os.listdir("/dev/shm"))
    procs = launch(2, [WORKER, "full"], timeout=120)
    for rank, lines in enumerate(_results(procs)):
        assert lines == ["shm False"], (rank, lines, procs[rank][2][-2000:])
    assert not [f for f in set(os.listdir("/dev/shm")) - before if f.startswith("hf_contextpar-")]


def test_model_decodes_through_it():
    """apply_context_parallel opens it, decode's gathers go through it, tokens are the single process's,
    remove_context_parallel closes it."""
    before = set(os.listdir("/dev/shm"))
    procs = launch(2, [WORKER, "model"], timeout=300)
    assert not [f for f in set(os.listdir("/dev/shm")) - before if f.startswith("hf_contextpar-")]  # unlinked at once
    ids = torch.randint(0, 256, (1, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = tiny_model("llama").generate(ids, max_new_tokens=6, do_sample=False)[0].tolist()
    for rank, lines in enumerate(_results(procs)):
        assert lines[0] == "shm True" and lines[2] == "closed True", (rank, lines, procs[rank][2][-2000:])
        assert int(lines[1].split()[-1]) > 0
        assert lines[3] == f"tokens {want}"
