"""The `slow` marker: `python -m pytest -m "not slow"` is the contributor's fast subset (a few
minutes on 2 cores), CI runs everything (`python -m pytest -q`).

The fast subset still touches every area: units, plans and caches, every attention algorithm on
simulated ranks, the kernels, the planner and predictions, one multi-process exactness family
(test_exact[N2-llama-*]), the world-size-1 smoke test, the error contract (in-process refusals and
one multi-process scenario), the eval harness's data and metrics, the self-test's checker, the
benchmark's bookkeeping, layout, docs and lint. What is slow is listed below, by module or by test
(optionally narrowed to some parameters); a name here that matches no collected test is an error,
so a renamed test cannot silently move into the fast subset. A module here is a test file's name: the file
in tests/unit (in-process tests), in tests/multi_process (tests that launch ranks) or both, where a feature has
both kinds; a (module, function) pair names the one that defines the function. See docs/testing.md.

The rotation: the exhaustive slices of the multi-process matrices (the exactness and hybrid matrices, split by
family: a family runs at N = 3 one day in six, at N = 4 one day in six and at N = 2 every third day (exactness;
every verified family's short check runs daily in test_families.py); N = 3 or 4,
on alternate days, of the CSA matrix; DCP's matrix on two days in six; one N of 2, 3, 4 a day of the strategy and multi-turn matrices and of the
census's re-run; the hybrid strategy matrix in two halves; N = 3 of the holes and user-code matrices; the geometry
and interleave matrices at one N a day; the exit check's three script orders one every sixth day each and two of its four tools a day;
one of lm-eval's six runs (3 processes, TP 2 x CP 2, two nodes, replicas two ways, the server); needlebench on
3 processes) run in some of SLICES slices, one slice picked
by the day (every slice runs every SLICES days) and printed in the header. Replay one with
HF_CONTEXTPAR_SLICE=k, run every slice with HF_CONTEXTPAR_SLICE=all. A run that names its tests (`-k`, a node
id) rotates nothing unless HF_CONTEXTPAR_SLICE is set: what it names runs, whatever the day. A marker expression
(`-m ring_pass_kv`, `-m "not slow"`) or a file path keeps the day's slice: it names an area or a file, not tests.

The area markers (`python -m pytest -m ring_pass_kv`: the tests aimed at hf_contextpar/attention/ring_pass_kv.py)
are assigned from tests/areas.py, the one table of areas, their source files and their tests.
"""

from __future__ import annotations

import datetime
import os
import zlib

import areas  # the area markers: which tests cover which source file (tests/ is on the path: pyproject.toml)
import pytest

# whole modules: multi-process matrices, the fuzz, process-exit checks, lm-eval runs
SLOW_MODULES = {
    "test_fuzz.py",
    "test_geometries.py",
    "test_holes.py",
    "test_interleave.py",
    "test_multiturn.py",
    "test_exit.py",
    "test_lmeval.py",
    "test_shm.py",
    "test_serve.py",
}

# (module, test function): the test is slow except for the parameter sets `keep` selects
# (a predicate of the test's parameters; None: every parameter set is slow)
SLOW_TESTS = {
    ("test_exactness.py", "test_exact"): lambda p: p["n"] == 2 and p["family"] == "llama",
    ("test_errors.py", "test_bad_input_is_rejected_on_every_rank"): lambda p: p["scenario"] == "mismatch",
    ("test_errors.py", "test_lost_rank_fails_the_others_within_the_timeout"): None,
    ("test_algorithms.py", "test_simulator_matches_the_real_comm"): None,
    ("test_strategies.py", "test_strategy_exact"): None,
    ("test_strategies.py", "test_traffic_matches_the_formulas"): None,
    ("test_strategies.py", "test_kvr_search_on_a_model"): None,
    ("test_strategies.py", "test_forward_with_autograd_on"): None,
    ("test_planner.py", "test_calibrate_and_sweep_commands"): None,
    ("test_predict.py", "test_cli_with_a_calibration_file"): None,
    ("test_cli.py", "test_cli_generate_under_torchrun"): None,
    ("test_cli.py", "test_eval_gate_does_not_pass_on_an_earlier_report"): None,
    ("test_cli.py", "test_eval_drops_an_earlier_report_before_anything_can_fail"): None,
    ("test_eval.py", "test_needlebench_equivalent_n2"): None,
    ("test_eval.py", "test_needlebench_needle_lm_n3_real_scores"): None,
    ("test_eval.py", "test_needlebench_broken_ring_is_not_equivalent"): None,
    ("test_eval.py", "test_bookcorpus_saved_reference_n2"): None,
    ("test_eval.py", "test_csa_report_beside_the_exact_run_n2"): None,
    ("test_eval.py", "test_csa_config_writes_settings_the_mode_loads"): None,
    ("test_selftest.py", "test_selftest_under_torchrun_on_cpu"): None,
    ("test_selftest.py", "test_a_broken_case_turns_the_verdict_to_fail"): None,
    ("test_selftest.py", "test_simulated_on_cpu"): None,
    ("test_bench.py", "test_bench_gloo_rows"): None,
    ("test_bench.py", "test_bench_end_to_end"): None,
    ("test_bench.py", "test_torch_ring_peer_exact"): None,
    ("test_bench.py", "test_comm_wait_accounting"): None,
    ("test_real_model.py", "test_retrieves_builtin_needles"): None,
    ("test_census.py", "test_rotating_families_keep_their_classification"): None,
    # every verified family in every run (about 80 s); the fast subset keeps llama and qwen4_exp_text (whose crash in
    # the sharded cache went unseen while the census re-ran a few families a day)
    ("test_families.py", "test_verified_family_is_exact"): lambda p: p["family"] in ("llama", "qwen4_exp_text"),
    ("test_families.py", "test_the_check_fails_a_broken_family"): None,
    ("test_hybrid.py", "test_hybrid_exact"): lambda p: p["n"] == 2 and p["family"] == "qwen3_next",
    ("test_hybrid.py", "test_hybrid_strategies"): None,
    ("test_hybrid.py", "test_state_list_exact"): None,
    ("test_csa.py", "test_csa_matches_its_reference_and_keep_all_is_exact"): lambda p: (
        p["n"] == 2 and p["case"] == "llama"
    ),
    ("test_user_code.py", "test_user_code"): None,  # one launch per N (about 25 s each on 2 cores)
    ("test_deepseek_v4.py", "test_exact_under_context_parallelism"): None,
    # TP x CP: the tp_cp matrix (one launch of 4 ranks) stays in the fast subset, the rest is slow
    ("test_tp.py", "test_dcp_exact"): None,
    ("test_tp.py", "test_dcp_refusals_and_fp32"): None,
    ("test_tp.py", "test_tp_disagreements_fail_on_every_rank"): None,
    ("test_tp.py", "test_tp_cp_fp32_tokens"): None,
    ("test_tp.py", "test_main_job_tp2_cp2"): None,
    ("test_tp.py", "test_bench_layouts"): None,
    ("test_tp.py", "test_main_job_tp4_dcp"): None,
    ("test_tp.py", "test_main_job_refuses_tp_that_splits_a_head"): None,
    # the area table's checks that collect the suite in a subprocess (about 20 s); its static checks stay fast
    ("test_areas.py", "test_a_keyword_selection_is_not_rotated"): None,
    ("test_areas.py", "test_a_node_id_is_not_rotated"): None,
    ("test_areas.py", "test_every_area_selects_tests_on_every_day"): None,
    ("test_areas.py", "test_every_entry_selects_a_test"): None,
}


SERVE_TESTS = (
    "test_completions_exact",
    "test_chat_exact_and_the_second_turn_reuses_the_kept_cache",
    "test_seeded_sampling_is_one_process_with_that_seed",
    "test_echo_and_logprobs_are_one_process_log_softmax",
    "test_a_client_gone_during_a_long_prefill_stops_it_at_a_layer",
    "test_bad_input_is_a_4xx_and_the_ranks_stay_in_step",
    "test_concurrent_clients_and_a_dropped_stream",
)
SLICES = 6  # the rotation's period in days: family splits repeat every 3, everything else every 2


def _by_name(name: str, n: int, period: int = 3) -> set[int]:
    """A family's slices at an N: one family in `period` (3 or 6) runs at that N on a given day, the Ns told
    apart by the offset n (the matrices are the suite's largest: a share each keeps CI in its time)."""
    share = (zlib.crc32(name.encode()) + n) % period
    return {k for k in range(SLICES) if k % period == share}


def _period(p: dict) -> int:
    """The exactness and hybrid matrices' split: a family runs at each N one day in six (every verified family's short
    check runs at N = 2 every day: tests/*/test_families.py)."""
    return 6


def _by_n(p: dict, key: str = "n") -> set[int] | None:
    """N = 3 on odd days, N = 4 on even days; N = 2 in every run."""
    return {k for k in range(SLICES) if k % 2 == p[key] % 2} if p[key] > 2 else None


def _one_n_a_day(n: int) -> set[int]:
    """Every third day: N = 2, 3 and 4 (or any three cases numbered alike) each on their own days."""
    return {k for k in range(SLICES) if k % 3 == n % 3}


def _alternate(parity: int) -> set[int]:
    """Every other day (the slices of that parity)."""
    return {k for k in range(SLICES) if k % 2 == parity}


# (module, test function) -> the slice a parameter set runs in, or None: every run
ROTATING = {
    # N = 2, 3 and 4 in sixths by family (tests/*/test_families.py checks every verified family at N = 2
    # every day), but for the fast subset's anchors, llama and qwen3_next, every day
    ("test_exactness.py", "test_exact"): lambda p: (
        None if (p["n"], p["family"]) == (2, "llama") else _by_name(p["family"], p["n"], _period(p))
    ),
    ("test_hybrid.py", "test_hybrid_exact"): lambda p: (
        None if (p["n"], p["family"]) == (2, "qwen3_next") else _by_name(p["family"], p["n"], _period(p))
    ),
    # the default strategy runs in test_hybrid_exact every day; the others two or three at a time
    ("test_hybrid.py", "test_hybrid_strategies"): lambda p: _alternate(
        1 if p["strategy"] in ("ring_pass_q", "ulysses") else 0
    ),
    # RWKV's state list (its generate and second turn at N = 2 run every day in test_families.py): one setting a day
    ("test_hybrid.py", "test_state_list_exact"): lambda p: _one_n_a_day(p["n"] + (p["strategy"] != "auto")),
    ("test_multiturn.py", "test_multiturn_exact_and_balanced"): lambda p: _one_n_a_day(p["n"]),
    ("test_strategies.py", "test_strategy_exact"): lambda p: _one_n_a_day(p["n"]),
    ("test_csa.py", "test_csa_matches_its_reference_and_keep_all_is_exact"): _by_n,
    ("test_strategies.py", "test_traffic_matches_the_formulas"): lambda p: _one_n_a_day(p["n"]),
    ("test_strategies.py", "test_kvr_search_on_a_model"): lambda p: _one_n_a_day(p["n"]),
    ("test_strategies.py", "test_forward_with_autograd_on"): lambda p: _one_n_a_day(p["n"]),
    ("test_census.py", "test_rotating_families_keep_their_classification"): lambda p: _one_n_a_day(p["world"]),
    ("test_geometries.py", "test_geometry_exact"): lambda p: _alternate(0) if p["n"] == 3 else _alternate(1),
    # ALiBi at 2,048 tokens (tests/workers/bias_worker.py): each case at each N one day in six
    ("test_score_bias.py", "test_alibi_exact_at_2k_tokens"): lambda p: _by_name(p["case"], p["n"], 6),
    ("test_holes.py", "test_case"): lambda p: _alternate(1) if p["n"] == 3 else None,
    ("test_interleave.py", "test_case"): lambda p: _alternate(0) if p["n"] == 3 else _alternate(1),
    ("test_user_code.py", "test_user_code"): lambda p: _alternate(1) if p["n"] == 3 else None,
    # the exit check's three script orders, one every sixth day each (group, model, library on slices 0, 2, 4)
    ("test_exit.py", "test_every_script_order_exits_cleanly"): lambda p: {
        2 * ("group", "model", "library").index(p["order"])
    },
    # lm-eval's six runs, one a day (each also needs the one-process reference run)
    ("test_lmeval.py", "test_three_processes_under_torchrun"): lambda p: {0},
    ("test_lmeval.py", "test_tensor_parallel_inside_context_parallel"): lambda p: {1},
    ("test_lmeval.py", "test_two_nodes_only_global_rank_zero_writes"): lambda p: {2},
    ("test_lmeval.py", "test_replicas_of_context_parallel_groups_through_accelerate"): lambda p: {3},
    ("test_lmeval.py", "test_replicas_of_tensor_and_context_parallel_groups"): lambda p: {4},  # 8 processes
    ("test_lmeval.py", "test_local_completions_through_the_server"): lambda p: {5},
    ("test_eval.py", "test_needlebench_needle_lm_n3_real_scores"): lambda p: _alternate(1),
    # replicas x CP: the harness's and the library's (lm-eval's is with its other runs above), on alternate days
    ("test_eval.py", "test_needlebench_replicas_write_the_single_groups_report"): lambda p: _alternate(0),
    ("test_replicas.py", "test_apply_makes_a_cp_group_per_replica"): lambda p: _alternate(1),
    # the server at N = 3 every other day (N = 2 every run)
    **{("test_serve.py", name): lambda p: _alternate(1) if p.get("server") == 3 else None for name in SERVE_TESTS},
    # DCP's matrix and its refusals on slices 1 and 3 (TP x CP's every day)
    ("test_tp.py", "test_dcp_exact"): lambda p: {1, 3},
    ("test_tp.py", "test_dcp_refusals_and_fp32"): lambda p: {1, 3},
    # one mechanism (comm/group.py's teardown) under four tools: two a day, the heavier pair on the lighter days
    ("test_exit.py", "test_tools_leave_no_gloo_thread_to_finalization"): lambda p: _alternate(
        1 if p["tool"] in ("bench", "eval") else 0
    ),
}


def rotation_slice(config=None) -> int | None:
    """The slice this run rotates in (None: all of them): HF_CONTEXTPAR_SLICE, else the day's, but none where the
    run names its tests itself (`-k`, a node id): an explicit selection is never emptied by the day's rotation."""
    chosen = os.environ.get("HF_CONTEXTPAR_SLICE", "")
    if chosen == "all" or (not chosen and config is not None and explicit_selection(config)):
        return None
    if chosen:
        return int(chosen) % SLICES
    return datetime.date.today().toordinal() % SLICES


def explicit_selection(config) -> bool:
    """The run selects tests by name: `-k EXPR` or a node id (`tests/unit/test_x.py::test_y[...]`). Not `-m`: a marker
    names an area (tests/areas.py) or the fast subset, whose matrices rotate as in CI (tests/unit/test_areas.py checks
    that every area marker selects tests on every day)."""
    return bool(config.option.keyword) or any("::" in str(arg) for arg in config.args)


def _rotation_line(config=None) -> str:
    k = rotation_slice(config)
    which = "every slice" if k is None else f"slice {k} of {SLICES}"
    return (
        f"hf-contextpar rotation: {which}; replay one with HF_CONTEXTPAR_SLICE=k (0..{SLICES - 1}), "
        "run all with HF_CONTEXTPAR_SLICE=all (tests/conftest.py ROTATING)"
    )


def pytest_configure(config):
    """Register the area markers from tests/areas.py, the one place they are assigned."""
    for marker, area in areas.MARKERS.items():
        config.addinivalue_line("markers", f"{marker}: {area.what} (tests/areas.py)")


def pytest_report_header(config):
    return _rotation_line(config)


def pytest_terminal_summary(terminalreporter):
    """The slice again at the end, where `-q` (which drops the header) still prints it."""
    terminalreporter.write_line(_rotation_line(terminalreporter.config))


def _rotated_out(module: str, name: str, params: dict, k: int | None) -> bool:
    rule = ROTATING.get((module, name))
    if rule is None or k is None:
        return False
    where = rule(params)
    return where is not None and k not in where


def _is_slow(module: str, name: str, params: dict) -> bool:
    if module in SLOW_MODULES:
        return True
    if (module, name) not in SLOW_TESTS:
        return False
    keep = SLOW_TESTS[module, name]
    return keep is None or not keep(params)


def _stale() -> list[str]:
    """Listed modules and tests that no longer exist (read from the test files, whatever is selected)."""
    missing = [m for m in sorted(SLOW_MODULES | {e[1] for e in areas.ENTRIES}) if not areas.defines(m, None)]
    for module, name in [*SLOW_TESTS, *ROTATING, *((e[1], e[2]) for e in areas.ENTRIES if e[2])]:
        if not areas.defines(module, name):
            missing.append(f"{module}::{name}")
    return missing


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselect
def pytest_collection_modifyitems(config, items):
    if stale := _stale():
        raise pytest.UsageError(
            f"tests/conftest.py or tests/areas.py lists tests that do not exist: {', '.join(stale)}"
        )
    k, kept, rotated = rotation_slice(config), [], []
    for item in items:
        name = getattr(item, "originalname", None) or item.name
        params = item.callspec.params if hasattr(item, "callspec") else {}
        if _is_slow(item.path.name, name, params):
            item.add_marker(pytest.mark.slow)
        for marker in sorted(areas.markers_of(item.path.name, name, params)):
            item.add_marker(marker)
        (rotated if _rotated_out(item.path.name, name, params, k) else kept).append(item)
    if rotated:
        config.hook.pytest_deselected(items=rotated)
        items[:] = kept
