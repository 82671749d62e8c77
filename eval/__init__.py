"""Exactness checks: compare a context-parallel run against the unpatched single-process model.

Installed as `hf_contextpar.eval`. `compare` holds the metrics the test suite and the CLI use.
"""

from .compare import logits_diff, first_divergence

__all__ = ["logits_diff", "first_divergence"]
