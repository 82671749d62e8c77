"""Exactness checks: compare a context-parallel run against the unpatched single-process model.

Installed as `hf_contextpar.eval`. `compare` holds the metrics the test suite and the harness use;
`python -m hf_contextpar.eval needlebench|bookcorpus` (under torchrun or accelerate launch) is the
harness itself: NeedleBench generation and BookCorpus teacher-forced windows, the unpatched model
on one process versus the patched model on N, with report.json, report.md and plots (see `cli`).
"""

from .compare import first_divergence, logits_diff

__all__ = ["logits_diff", "first_divergence"]
