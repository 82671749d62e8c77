"""Data-parallel replicas x context parallelism (issue 59): the layout of accelerate's `ParallelismConfig` (its
environment, or a tool's `cp_size`), checked and turned into one CP group per replica. In process: the layout's
arithmetic and its refusals; launched (4 processes): `apply_context_parallel(model)` under the environment puts
each rank in its replica's CP group of 2, each replica exact on its own prompt. lm-eval over replicas is
tests/*/test_lmeval.py's.

This file holds the checks that run in the pytest process; the ones that launch ranks are in tests/multi_process/test_replicas.py.
"""

from __future__ import annotations

import pytest

from hf_contextpar.comm.replicas import Replicas, accelerate_layout
from hf_contextpar.errors import ContextParallelError

ENV_KEYS = ("DP_REPLICATE", "DP_SHARD", "CP", "SP", "TP")


@pytest.fixture
def env(monkeypatch):
    for key in ENV_KEYS:
        monkeypatch.delenv(f"PARALLELISM_CONFIG_{key}_SIZE", raising=False)
    monkeypatch.delenv("PARALLELISM_CONFIG_CP_BACKEND", raising=False)

    def set_sizes(**sizes):
        for key, value in sizes.items():
            monkeypatch.setenv(f"PARALLELISM_CONFIG_{key.upper()}_SIZE", str(value))

    return set_sizes


def test_ranks_follow_accelerates_mesh_order():
    layout = Replicas.of(8, cp=2, tp=2)  # 2 replicas of CP 2 x TP 2: TP innermost, then CP, then replicas
    assert layout == Replicas(2, 2, 2)
    assert [layout.coordinates(r) for r in (0, 1, 2, 5, 7)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 1), (1, 1, 1)]
    assert layout.cp_ranks(1, 0) == [4, 6] and layout.across_ranks(1, 1) == [3, 7]
    assert Replicas.of(4) == Replicas(1, 4, 1)  # no cp_size: one CP group of every rank


@pytest.mark.parametrize("world, cp, tp", [(4, 3, 1), (6, 2, 4), (4, 0, 1)])
def test_a_layout_that_does_not_divide_is_refused(world, cp, tp):
    with pytest.raises(ContextParallelError, match="must divide the number of processes"):
        Replicas.of(world, cp, tp)


@pytest.mark.filterwarnings("ignore:the accelerate parallelism config")
def test_the_environment_is_read_and_checked(env):
    assert accelerate_layout(4) is None  # nothing set: no layout
    env(dp_replicate=2, cp=2)
    with pytest.warns(UserWarning, match="cp_backend"):  # accelerate's training CP: ignored, said
        assert accelerate_layout(4) == Replicas(2, 2, 1)
    with pytest.raises(ContextParallelError, match="describes 4 processes .* 6 were launched"):
        accelerate_layout(6)
    env(dp_replicate=1, dp_shard=2, cp=1, tp=2)  # sharded data parallelism is a replica too, for inference
    assert accelerate_layout(4) == Replicas(2, 1, 2)
    env(sp=2)
    with pytest.raises(ContextParallelError, match="strategy='ulysses'"):
        accelerate_layout(4)
    env(sp=1, cp="two")
    with pytest.raises(ContextParallelError, match="positive number"):
        accelerate_layout(4)


def test_an_accelerators_parallelism_config_is_read(env):
    """The object form: the config an `Accelerator(parallelism_config=...)` keeps in accelerate's shared state
    (accelerate's own class, whose unset sizes it reads from the environment; sharded data parallelism counts
    as replicas for inference)."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    config = accelerate.ParallelismConfig(dp_shard_size=2, cp_size=2, tp_size=2)
    AcceleratorState._shared_state["parallelism_config"] = config  # what Accelerator.__init__ stores
    try:
        with pytest.warns(UserWarning, match="cp_backend"):
            assert accelerate_layout(8) == Replicas(2, 2, 2)
    finally:
        AcceleratorState._shared_state.pop("parallelism_config", None)


def test_lm_eval_reads_cp_size(env, monkeypatch):
    pytest.importorskip("lm_eval")
    from hf_contextpar.tools.lmeval import _layout

    monkeypatch.setenv("WORLD_SIZE", "8")
    assert _layout(None, 1) is None and _layout("8", 1) is None  # one replica: as without cp_size
    assert _layout("2", 1) == Replicas(4, 2, 1) and _layout("2", 2) == Replicas(2, 2, 2)
    with pytest.raises(ValueError, match="cp_size must be a positive number"):
        _layout("x", 1)
    with pytest.raises(ContextParallelError, match="must divide"):
        _layout("3", 1)
    env(dp_replicate=2, cp=2, tp=2)
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="pass tp=2"):
        _layout(None, 1)
