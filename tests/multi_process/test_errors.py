"""Bad input fails with a clear error, on every rank, instead of a hang or a wrong answer.

This file holds the checks that launch ranks (tests/launch.py); the others, and the feature's whole description, are in
tests/unit/test_errors.py.
"""

from __future__ import annotations

import pytest
from launch import launch, worker_path

import hf_contextpar

WORKER = worker_path("error_worker.py")


def _results(procs):
    return [[line[7:] for line in out.splitlines() if line.startswith("RESULT ")] for _, out, _ in procs]


# scenarios that leave the ranks at different collectives (one rank done, one decoding; a group made on one
# rank only): a launch each; the others run in one launch together (error_worker.py)
ALONE = {"timeout_differs", "max_new_differs"}
_batches: dict = {}


def _by_scenario(procs) -> list[dict]:
    """Per rank: scenario -> its RESULT lines (error_worker prints SCENARIO before each)."""
    out = []
    for _, stdout, _ in procs:
        lines, scenario = {}, None
        for line in stdout.splitlines():
            if line.startswith("SCENARIO "):
                scenario = line[9:]
                lines[scenario] = []
            elif line.startswith("RESULT ") and scenario is not None:
                lines[scenario].append(line[7:])
        out.append(lines)
    return out


def _scenario_lines(scenario: str, request) -> tuple[list, list]:
    """(per rank: the scenario's RESULT lines, per rank: stderr), from its own launch or the session's batch."""
    if scenario in ALONE:
        procs = launch(2, [WORKER, scenario], timeout=300)
        return _results(procs), [err for _, _, err in procs]
    batch = tuple(
        item.callspec.params["scenario"]
        for item in request.session.items
        if getattr(item, "originalname", None) == request.node.originalname
        and item.callspec.params["scenario"] not in ALONE
    )
    if batch not in _batches:
        procs = launch(2, [WORKER, ",".join(batch)], timeout=900)
        _batches[batch] = (_by_scenario(procs), [err for _, _, err in procs])
    per_rank, errs = _batches[batch]
    return [lines.get(scenario, []) for lines in per_rank], errs


@pytest.mark.parametrize(
    "scenario,error,needle",
    [
        ("mismatch", "RankMismatchError", "different inputs"),
        ("mismatch_decode", "RankMismatchError", "different inputs"),  # the check under the decode step
        ("mask4d", "UnsupportedInputError", "2D padding mask"),
        ("labels", "UnsupportedInputError", "labels are not supported"),
        ("foreign_cache", "CacheMismatchError", "cannot be used under context parallelism"),
        ("batch_grows", "CacheMismatchError", "the cache holds 1 sequences but the input has 2"),
        ("batch_shrinks", "CacheMismatchError", "the cache holds 2 sequences but the input has 1"),
        ("after_remove", "PatchStateError", "works only with the patched model"),
        ("attn_changed", "PatchStateError", "changed after apply_context_parallel"),
        ("keep_differs", "RankMismatchError", "different inputs"),
        ("max_new_differs", "RankMismatchError", "different"),  # rank 0: different sequences, rank 1: inputs
        ("dropout", "UnsupportedModelError", "attention dropout is not supported"),
        ("deepcopy", "PatchStateError", "cannot be deep-copied"),
        ("timeout_differs", "RankMismatchError", "different timeout on different ranks"),
        ("partitions_differ", "RankMismatchError", "different partitions on different"),
        ("lookup_from_embeds", "CandidateDecodingError", "decoding from inputs_embeds are not supported"),
        ("lookup_from_embeds_unchecked", "CandidateDecodingError", "decoding from inputs_embeds are not supported"),
        ("zero_tokens", "UnsupportedInputError", "the input holds no tokens"),
        ("negative_keep", "UnsupportedInputError", "a negative int is not supported"),
        ("registered_diffllama", "UnsupportedModelError", "more than once per forward"),
        ("registered_jetmoe", "UnsupportedModelError", "other keys or values than a cache layer returned"),
        ("registered_gpt_neo", "UnsupportedModelError", "AttentionInterface"),
        ("registered_doge", "UnsupportedModelError", "score bias or mask of its own"),
        ("diffllama_ulysses", "HeadsNotDivisibleError", "expansion of its cached K/V over all its KV heads"),
        ("dsa_pass_q", "UnsupportedModelError", "strategy='ring_pass_q' (it moves queries between ranks)"),
        ("dsa_decode_pass_q", "UnsupportedModelError", "decode='ring_pass_q' (batched pass-Q decode moves"),
    ],
)
def test_bad_input_is_rejected_on_every_rank(scenario, error, needle, request):
    """Each refusal has its type (a subclass of ContextParallelError), on every rank."""
    assert issubclass(getattr(hf_contextpar, error), hf_contextpar.ContextParallelError)
    results, errs = _scenario_lines(scenario, request)
    for rank, lines in enumerate(results):
        assert lines and lines[-1].startswith(error + " ") and needle in lines[-1], (rank, lines, errs[rank][-2000:])


@pytest.mark.parametrize("scenario,code,limit", [("dies", 3, 15), ("stalls", 4, 30)])
def test_lost_rank_fails_the_others_within_the_timeout(scenario, code, limit):
    """A peer that exits, or stalls without exiting, makes rank 0 raise within the 8 s timeout."""
    procs = launch(2, [WORKER, scenario], timeout=300, env={"CP_TIMEOUT": "8"})
    assert procs[1][0] == code
    lines = _results(procs)[0]
    assert any(line.startswith("PeerFailureError ") for line in lines), procs[0][2][-2000:]
    elapsed = float(next(line for line in lines if line.startswith("elapsed")).split()[1])
    assert elapsed < limit
