"""The `slow` marker: `python -m pytest -m "not slow"` is the contributor's fast subset (a few
minutes on 2 cores), CI runs everything (`python -m pytest -q`).

The fast subset still touches every area: units, plans and caches, every attention algorithm on
simulated ranks, the kernels, the planner and predictions, one multi-process exactness family
(test_exact[N2-llama-*]), the world-size-1 smoke test, the error contract (in-process refusals and
one multi-process scenario), the eval harness's data and metrics, the self-test's checker, the
benchmark's bookkeeping, layout, docs and lint. What is slow is listed below, by module or by test
(optionally narrowed to some parameters); a name here that matches no collected test is an error,
so a renamed test cannot silently move into the fast subset. See docs/testing.md.
"""

from __future__ import annotations

from pathlib import Path

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
    ("test_selftest.py", "test_selftest_under_torchrun_on_cpu"): None,
    ("test_selftest.py", "test_a_broken_case_turns_the_verdict_to_fail"): None,
    ("test_selftest.py", "test_simulated_on_cpu"): None,
    ("test_bench.py", "test_bench_gloo_rows"): None,
    ("test_bench.py", "test_bench_end_to_end"): None,
    ("test_bench.py", "test_torch_ring_peer_exact"): None,
    ("test_bench.py", "test_comm_wait_accounting"): None,
    ("test_real_model.py", "test_retrieves_builtin_needles"): None,
    ("test_census.py", "test_rotating_families_keep_their_classification"): None,
    ("test_hybrid.py", "test_hybrid_exact"): lambda p: p["n"] == 2 and p["family"] == "qwen3_next",
    ("test_hybrid.py", "test_hybrid_strategies"): None,
}


def _is_slow(module: str, name: str, params: dict) -> bool:
    if module in SLOW_MODULES:
        return True
    if (module, name) not in SLOW_TESTS:
        return False
    keep = SLOW_TESTS[module, name]
    return keep is None or not keep(params)


def _stale() -> list[str]:
    """Listed modules and tests that no longer exist (read from the test files, whatever is selected)."""
    here = Path(__file__).parent
    missing = [m for m in sorted(SLOW_MODULES) if not (here / m).exists()]
    for module, name in SLOW_TESTS:
        path = here / module
        if not path.exists() or f"def {name}(" not in path.read_text():
            missing.append(f"{module}::{name}")
    return missing


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselect
def pytest_collection_modifyitems(config, items):
    if stale := _stale():
        raise pytest.UsageError(f"tests/conftest.py lists slow tests that do not exist: {', '.join(stale)}")
    for item in items:
        name = getattr(item, "originalname", None) or item.name
        params = item.callspec.params if hasattr(item, "callspec") else {}
        if _is_slow(item.path.name, name, params):
            item.add_marker(pytest.mark.slow)
