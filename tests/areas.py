"""Which tests cover which source file: one marker per area of the code, assigned here and nowhere else.

    python -m pytest -m ring_pass_kv                 # the tests aimed at attention/ring_pass_kv.py
    python tests/areas.py hf_contextpar/cache/recurrent.py    # which markers cover a file, and the command

An area is a marker (registered by tests/conftest.py from this table, so `pytest --markers` lists them), the
source files it covers (paths from the repository root; a glob only where a whole folder is one area) and the
tests aimed at them: a module (`test_x.py`: its file in tests/unit and its file in tests/multi_process, where the
feature has both), a test function (`test_x.py::test_y`, in whichever of the two defines it), or a test function with a
predicate of its parameters (`("test_x.py::test_y", lambda p: ...)`, as in conftest's SLOW_TESTS). The end-to-end
tests that run a whole model through every file (the exactness matrix, the fuzz, every family, the geometries)
carry the marker `end_to_end`: `-m "ring_pass_kv or end_to_end"` adds them; the repository's rules (docs, lint,
layout, this table) carry `house`. Every test file is named here.

tests/unit/test_areas.py keeps this table true: every module of the installed packages (hf_contextpar/, patches/, eval/)
is a source of some area, every source and test named here exists, and every area keeps a test that the day's
rotation never drops (so `-m AREA` selects tests on any day). A new module without tests fails it.
"""

from __future__ import annotations

import fnmatch
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("unit", "multi_process")  # tests/unit: in the pytest process; tests/multi_process: they start ranks or servers
PACKAGES = ("hf_contextpar", "patches", "eval")  # what pyproject.toml installs (patches/, eval/ under hf_contextpar.)


@dataclass(frozen=True)
class Area:
    what: str
    sources: tuple[str, ...]
    tests: tuple[str | tuple[str, Callable[[dict], bool]], ...]


def _algorithm(name: str):
    """test_algorithms.py::test_algorithm's cases that run one attention algorithm (the spec's Case.algorithm)."""
    return ("test_algorithms.py::test_algorithm", lambda p: p["case"].algorithm == name)


def _strategy(name: str, hybrid: str | None = None):
    """test_hybrid.py::test_hybrid_strategies (at `hybrid`, its name there) and test_strategies.py::test_strategy_exact
    at one strategy, and the traffic of every strategy."""
    return [
        ("test_hybrid.py::test_hybrid_strategies", lambda p: p["strategy"] == (hybrid or name)),
        ("test_strategies.py::test_strategy_exact", lambda p: p["strategy"] == name),
        TRAFFIC,
    ]


A = "hf_contextpar/attention/"
TRAFFIC = "test_strategies.py::test_traffic_matches_the_formulas"  # every strategy's bytes against its formula
ANCHOR = ("test_exactness.py::test_exact", lambda p: (p["n"], p["family"]) == (2, "llama"))  # the default path, daily

AREAS: dict[str, Area] = {
    # the attention algorithms, one file each (plan/strategies.py holds their records)
    "ring_pass_kv": Area(
        "ring pass-KV prefill (Meta CP Alg. 2)",
        (A + "ring_pass_kv.py",),
        (
            _algorithm("ring_pass_kv"),
            "test_algorithms.py::test_random_forward_sequences",
            "test_algorithms.py::test_a_skipped_last_ring_hop_fails",
            "test_algorithms.py::test_a_wrong_message_size_is_an_error",
            "test_algorithms.py::test_simulator_matches_the_real_comm",
            ("test_hybrid.py::test_hybrid_strategies", lambda p: p["strategy"] in ("ring_pass_kv", "uneven")),
            "test_eval.py::test_needlebench_broken_ring_is_not_equivalent",
            "test_multiturn.py",  # partial prefill over a kept cache (KV-Runahead's too) runs ring pass-KV
            TRAFFIC,
            ANCHOR,
        ),
    ),
    "ring_pass_q": Area(
        "ring pass-Q prefill and batched pass-Q decode (Meta CP Alg. 3, 4)",
        (A + "ring_pass_q.py", A + "ring_pass_q_decode.py"),
        (
            _algorithm("ring_pass_q"),
            _algorithm("ring_pass_q_decode"),
            "test_algorithms.py::test_random_forward_sequences",
            ("test_hybrid.py::test_hybrid_strategies", lambda p: p["strategy"] == "ring_pass_q"),
            "test_multiturn.py",
            TRAFFIC,
        ),
    ),
    "allgather_kv": Area(
        "all-gather KV prefill (Llama 3, vLLM PCP)",
        (A + "allgather_kv.py",),
        (_algorithm("allgather_kv"), "test_algorithms.py::test_random_forward_sequences", *_strategy("allgather_kv")),
    ),
    "ulysses": Area(
        "Ulysses head all-to-all (CSPS SP-NTP)",
        (A + "ulysses.py",),
        (
            _algorithm("ulysses"),
            "test_algorithms.py::test_random_forward_sequences",
            "test_tp.py::test_tp_head_checks",
            *_strategy("ulysses"),
        ),
    ),
    "kv_runahead": Area(
        "KV-Runahead: the send/recv chain and its uneven partitions (search, table, balanced by measured work)",
        (A + "kv_runahead.py", "hf_contextpar/plan/partitions.py"),
        (
            _algorithm("kv_runahead"),
            *_strategy("kv_runahead", hybrid="uneven"),  # test_hybrid_strategies' uneven partitions
            "test_strategies.py::test_kvr_search_on_a_model",
            "test_strategies.py::test_search_finds_the_minimum_of_a_known_cost",
            "test_strategies.py::test_partition_table_interpolates_and_clamps",
            "test_strategies.py::test_partition_sizes_are_exact",
            "test_units.py::test_balanced_partitions_equalise_predicted_work",
            "test_units.py::test_kv_runahead_posts_receives_for_the_layer_attended_next",
            "test_units.py::test_measured_work_fits_the_ranks_busy_times",
        ),
    ),
    "decode": Area(
        "replicated decode (vLLM DCP's merge, CSPS broadcast-Q) and local attention",
        (A + "decode.py", A + "local.py"),
        (
            _algorithm("replicated_decode"),
            _algorithm("local"),
            "test_algorithms.py::test_random_forward_sequences",
            "test_units.py::test_decode_merge_equals_the_full_merge",
            "test_interleave.py",
            ANCHOR,
        ),
    ),
    "attention": Area(
        "the attention adapter, one rank's step, the kernels, masks and the out+LSE merge, the coverage guard",
        (
            A + "__init__.py",
            A + "bias.py",
            A + "call.py",
            A + "coverage.py",
            A + "kernels.py",
            A + "masks.py",
            A + "merge.py",
            A + "step.py",
        ),
        (
            "test_algorithms.py",
            "test_kernel_tiles.py",
            "test_units.py::test_attend_matches_math",
            "test_units.py::test_merge_of_key_splits_is_exact",
            "test_units.py::test_accumulator_merges_partials_over_row_ranges",
            "test_units.py::test_sinks_enter_the_merge_once",
            "test_units.py::test_merge_keeps_empty_rows_finite",
            "test_units.py::test_attend_with_per_sequence_key_columns",
            "test_units.py::test_attend_with_a_selection_over_key_blocks_is_the_masked_whole",
            "test_units.py::test_pack_partial_is_its_definition",
            "test_user_code.py",  # the coverage guard: attention forwards that bypass the library
            "test_family_patches.py",
            "test_score_bias.py",
            ANCHOR,
        ),
    ),
    "indexed": Area(
        "indexed attention (DeepSeek Sparse Attention: the indexer's top-k; MiniMax-M3's top key blocks)",
        (A + "indexed.py", "patches/minimax_m3.py"),
        (
            "test_errors.py::test_indexed_attention_refuses_what_moves_a_query_from_its_top_k",
            "test_cache.py::test_index_keys_follow_the_cache_through_beams_crop_and_failure",
            "test_cache.py::test_a_narrowed_indexer_mask_is_the_layers_selection",
            "test_cache.py::test_update_index_hands_every_column_of_one_head_in_order",
            "test_cache.py::test_a_block_indexers_top_blocks_are_its_layers_selection_per_kv_head",
            "test_units.py::test_attend_with_a_selection_over_key_blocks_is_the_masked_whole",
            ("test_exactness.py::test_exact", lambda p: p["family"].startswith(("deepseek_v32", "glm_moe_dsa"))),
            "test_geometries.py",
        ),
    ),
    "latent": Area(
        "latent KV (multi-head latent attention, MLA)",
        (A + "latent.py",),
        (
            ("test_algorithms.py::test_algorithm", lambda p: p["heads"] == "mla"),
            ("test_exactness.py::test_exact", lambda p: p["family"].startswith(("deepseek", "glm_moe_dsa"))),
        ),
    ),
    "compressed": Area(
        "DeepSeek-V4's compressed attention: entries beside the cache's K/V",
        (A + "entries.py", "patches/deepseek_v4.py"),
        ("test_deepseek_v4.py",),
    ),
    "csa": Area(
        "CSPS's sparse attention (CSA), approximate and opt in, and its eval mode",
        (A + "csa.py", "hf_contextpar/sparse/*.py", "eval/csa_*.py"),
        (
            "test_csa.py",
            "test_eval.py::test_csa_report_beside_the_exact_run_n2",
            "test_eval.py::test_csa_config_writes_settings_the_mode_loads",
        ),
    ),
    # the cache
    "cache": Area(
        "the sharded KV cache (transformers' Cache API) and its K/V block",
        (
            "hf_contextpar/cache/__init__.py",
            "hf_contextpar/cache/blocks.py",
            "hf_contextpar/cache/layers.py",
            "hf_contextpar/cache/sharded.py",
            "hf_contextpar/plan/context.py",  # the per-forward context the cache and the attention are handed
        ),
        ("test_cache.py", "test_multiturn.py", "test_interleave.py", ANCHOR),
    ),
    "recurrent": Area(
        "recurrent layers (linear attention, state-space, convolutions): the state chain and the states' wire format",
        (
            "hf_contextpar/cache/recurrent.py",
            "hf_contextpar/cache/states.py",
            "patches/gated_delta.py",
            "patches/mamba1.py",
            "patches/recurrent_gemma.py",
            "patches/rwkv.py",
            "patches/xlstm.py",
        ),
        (
            "test_recurrent.py",
            "test_hybrid.py",
            "test_cache.py::test_recurrent_and_hybrid_layers_keep_transformers_semantics",
        ),
    ),
    # the plan and the planner
    "plan": Area(
        "the forward plan: sharding, the cache's shard layout, the strategy records",
        (
            "hf_contextpar/plan/__init__.py",
            "hf_contextpar/plan/forward.py",
            "hf_contextpar/plan/layout.py",
            "hf_contextpar/plan/policy.py",  # strategy choice and partition sizing: what a prefill runs, and why
            "hf_contextpar/plan/sharding.py",
            "hf_contextpar/plan/strategies.py",
        ),
        (
            "test_plan.py",
            "test_units.py::test_head_tail_covers_and_balances",
            "test_units.py::test_head_tail_keeps_shards_even_over_turns",
            "test_units.py::test_least_loaded_evens_out_and_round_robins",
            "test_algorithms.py::test_a_new_strategy_is_one_file_and_one_record",
            "test_strategies.py::test_traffic_matches_the_formulas",
        ),
    ),
    "planner": Area(
        "the cost model, pass-KV / pass-Q choice, the machine, calibration and `predict`",
        (
            "hf_contextpar/plan/choice.py",
            "hf_contextpar/plan/costmodel.py",
            "hf_contextpar/plan/machine.py",
            "hf_contextpar/model/shape.py",
            "hf_contextpar/tools/calibrate.py",
            "hf_contextpar/tools/predict.py",
        ),
        ("test_planner.py", "test_predict.py"),
    ),
    # between the ranks
    "comm": Area(
        "the process group, the collectives with byte accounting, rank agreement, clean exit",
        (
            "hf_contextpar/comm/__init__.py",
            "hf_contextpar/comm/collectives.py",
            "hf_contextpar/comm/group.py",
            "hf_contextpar/comm/agreement.py",
        ),
        (
            "test_algorithms.py::test_simulator_matches_the_real_comm",
            "test_algorithms.py::test_a_missing_send_times_out_instead_of_hanging",
            "test_algorithms.py::test_a_send_waited_before_the_peer_posts_its_receive_deadlocks",
            "test_algorithms.py::test_a_message_never_received_is_an_error",
            "test_algorithms.py::test_mismatched_collectives_are_an_error",
            "test_units.py::test_input_fingerprint_is_its_definition",
            "test_errors.py",
            "test_exit.py",
        ),
    ),
    "shm": Area("the shared-memory all-gather of CPU ranks", ("hf_contextpar/comm/shm.py",), ("test_shm.py",)),
    "replicas": Area(
        "data-parallel replicas x CP (x TP): accelerate's parallelism config, lm-eval's and the harness's replicas",
        ("hf_contextpar/comm/replicas.py",),
        (
            "test_replicas.py",
            "test_lmeval.py::test_replicas_of_context_parallel_groups_through_accelerate",
            "test_lmeval.py::test_replicas_of_tensor_and_context_parallel_groups",
            "test_eval.py::test_needlebench_replicas_write_the_single_groups_report",
        ),
    ),
    "tp": Area(
        "tensor parallelism inside x context parallelism across, DCP, and the (tp, cp) layout",
        ("hf_contextpar/mesh.py", "hf_contextpar/tools/tpload.py", "hf_contextpar/tools/layout.py"),
        ("test_tp.py", "test_tp_layouts.py", "test_lmeval.py::test_tensor_parallel_inside_context_parallel"),
    ),
    "dcp": Area(
        "DCP: more TP ranks than KV heads, the KV cache's slots split over them",
        ("hf_contextpar/plan/layout.py", A + "decode.py"),
        (
            "test_tp.py::test_dcp_exact",
            "test_tp.py::test_dcp_refusals_and_fp32",
            "test_tp.py::test_dcp_slot_split",
            "test_tp.py::test_main_job_tp4_dcp",
        ),
    ),
    # the model's side and the public face
    "contract": Area(
        "the input contract, what a model cannot combine, and the typed errors",
        (
            "hf_contextpar/model/__init__.py",
            "hf_contextpar/model/contract.py",
            "hf_contextpar/model/candidates.py",
            "hf_contextpar/capabilities.py",
            "hf_contextpar/errors.py",
            "hf_contextpar/config.py",
        ),
        (
            "test_errors.py",
            "test_user_code.py",
            "test_units.py::test_candidate_decoding_is_refused_from_embeddings_and_over_a_filled_cache",
            "test_tp.py::test_tp_head_checks",
            "test_cache.py::test_a_looped_models_cache_holds_each_loops_copy_as_one_process_appends_it",
        ),
    ),
    "runtime": Area(
        "apply / remove, the settings, the hooks around each forward, gathering the outputs",
        (
            "hf_contextpar/__init__.py",
            "hf_contextpar/api.py",
            "hf_contextpar/runtime.py",
            "hf_contextpar/patched.py",
            "hf_contextpar/ledger.py",
            "hf_contextpar/settings.py",
            "hf_contextpar/inputs.py",
            "hf_contextpar/outputs.py",
        ),
        (
            "test_units.py::test_gather_rows_puts_every_ranks_rows_back_along_the_token_or_batch_dim",
            "test_errors.py::test_single_process_is_a_faithful_no_op",
            "test_cache.py::test_failed_forward_leaves_no_trace",
            "test_user_code.py",
            ANCHOR,
        ),
    ),
    "families": Area(
        "the family registry (model/families.py) and the patches that fill it, position-dependent RoPE, built-in models",
        ("patches/*.py", "hf_contextpar/model/families.py", "hf_contextpar/model/rope.py", "hf_contextpar/models.py"),
        (
            "test_families.py",
            "test_family_patches.py",
            "test_score_bias.py",
            "test_census.py",
            "test_real_model.py",
            "test_geometries.py",
            "test_user_code.py::test_reregistering_a_verified_family_is_refused",
            "test_errors.py::test_unsupported_models_are_rejected",
        ),
    ),
    # the tools
    "cli": Area(
        "the command line: generate, the presets and built-in names, argument checks",
        (
            "hf_contextpar/__main__.py",
            "hf_contextpar/cliargs.py",
            "hf_contextpar/tools/__init__.py",
            "hf_contextpar/tools/cli.py",
            "hf_contextpar/tools/models.py",
            "hf_contextpar/tools/presets.py",
        ),
        ("test_cli.py", "test_exit.py::test_cli_exits_zero_every_time"),
    ),
    "serve": Area(
        "the OpenAI-compatible server",
        ("hf_contextpar/tools/serve/*.py",),
        ("test_serve.py", "test_conversations.py", "test_lmeval.py::test_local_completions_through_the_server"),
    ),
    "bench": Area(
        "the benchmark",
        ("hf_contextpar/bench.py", "hf_contextpar/tools/bench/*.py"),
        ("test_bench.py", "test_tp.py::test_bench_layouts"),
    ),
    "selftest": Area(
        "the self-test and the simulated ranks (the algorithms' specification)",
        ("hf_contextpar/tools/selftest/*.py",),
        ("test_selftest.py", "test_algorithms.py", "test_cuda.py"),
    ),
    "eval": Area(
        "the exactness harness (NeedleBench, BookCorpus, reports) and the oracle",
        ("eval/*.py",),
        ("test_eval.py", "test_oracle.py"),
    ),
    "lmeval": Area("lm-eval's hf-cp model", ("hf_contextpar/tools/lmeval.py",), ("test_lmeval.py",)),
}

# whole-model runs through every file: their own marker, added to an area's selection with `or end_to_end`
END_TO_END = Area(
    "whole models through every file: the exactness matrix, every verified family, the fuzz, geometries, holes",
    (),
    ("test_exactness.py", "test_families.py", "test_fuzz.py", "test_geometries.py", "test_holes.py", "test_hybrid.py"),
)
# the repository's own rules, about no one source file: the docs, lint and format, the import layout, this table
HOUSE = Area(
    "the repository's rules: docs, lint and format, the import layout, this table",
    (),
    ("test_docs.py", "test_lint.py", "test_layout.py", "test_areas.py"),
)
MARKERS = {**AREAS, "end_to_end": END_TO_END, "house": HOUSE}


def _entries():
    """(marker, module, function or None, predicate or None) for every test entry."""
    for marker, area in MARKERS.items():
        for entry in area.tests:
            name, keep = entry if isinstance(entry, tuple) else (entry, None)
            module, _, function = name.partition("::")
            yield marker, module, function or None, keep


ENTRIES = list(_entries())


def entries_of(module: str, function: str, params: dict) -> list[int]:
    """The entries (indices into ENTRIES) that select one collected test (its module's file name, its function, its
    parameters)."""
    return [
        i
        for i, (_, mod, fn, keep) in enumerate(ENTRIES)
        if mod == module and fn in (None, function) and (keep is None or keep(params))
    ]


def markers_of(module: str, function: str, params: dict) -> set[str]:
    """The area markers of one collected test."""
    return {ENTRIES[i][0] for i in entries_of(module, function, params)}


def test_files(module: str | None = None) -> list[Path]:
    """The test files named `module` (a file name: a feature's in-process half in tests/unit and its multi-process
    half in tests/multi_process share it), or every test file."""
    return sorted(p for kind in KINDS for p in (ROOT / "tests" / kind).glob(module or "test_*.py"))


def defines(module: str, function: str | None) -> bool:
    """A test file of that name exists and, if `function` is given, one of them defines it."""
    files = test_files(module)
    return bool(files) and (function is None or any(f"def {function}(" in p.read_text() for p in files))


def source_files() -> list[str]:
    """Every module of the installed packages, from the repository root."""
    return sorted(str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def areas_of(path: str) -> list[str]:
    """The areas whose sources include `path` (from the repository root, or absolute)."""
    given = Path(path)
    if given.is_absolute():
        if not given.resolve().is_relative_to(ROOT):
            return []
        given = given.resolve().relative_to(ROOT)
    rel = given.as_posix()
    return [m for m, area in AREAS.items() if any(fnmatch.fnmatchcase(rel, pattern) for pattern in area.sources)]


def main(argv: list[str]) -> int:
    """`python tests/areas.py FILE...`: the markers that cover each file and the pytest command running them."""
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    found: list[str] = []
    for path in argv:
        areas = areas_of(path)
        print(f"{path}: {', '.join(areas) if areas else 'no area (add it to tests/areas.py)'}")
        found += [a for a in areas if a not in found]
    if not found:
        return 1
    expr = " or ".join(found)
    grouped = f"({expr})" if len(found) > 1 else expr
    commands = [
        (f'python -m pytest -q -m "{expr}"', "the tests aimed at it (today's slice of its matrices)"),
        (f'python -m pytest -q -m "{grouped} and not slow"', "its share of the fast subset"),
        (f'python -m pytest -q -m "{expr} or end_to_end"', "and the whole-model runs through every file"),
        (f'HF_CONTEXTPAR_SLICE=all python -m pytest -q -m "{expr}"', "every slice of the rotation"),
    ]
    width = max(len(c) for c, _ in commands)
    for command, what in commands:
        print(f"{command.ljust(width)}   # {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
