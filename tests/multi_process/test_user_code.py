"""What users do around a patched model (issue 42), exact or refused with a typed error on every rank:
custom attention functions, attention forwards patched to call SDPA themselves, caches copied and continued,
training mode, model.forward and the inner decoder, PEFT's LoRA, compile order, re-registered families and
dropped models. The multi-process cases run in one launch per N (tests/workers/user_code_worker.py).

This file holds the checks that launch ranks (tests/launch.py); the others, and the feature's whole description, are in
tests/unit/test_user_code.py.
"""

from __future__ import annotations

import pytest
from launch import matrix, selected
from user_code_worker import cases

NAMES = [name for name, _ in cases(2)]


@pytest.mark.parametrize("case", NAMES)
@pytest.mark.parametrize("n", [2, 3])
def test_user_code(n, case, tmp_path_factory, request):
    args = selected(request, "case", NAMES)  # -k starts only the cases it selects
    for rank, records in enumerate(matrix("user_code_worker.py", n, tmp_path_factory, args)):
        (r,) = [r for r in records if r["case"] == case]
        assert r["ok"], f"rank {rank}: {r}"
