"""Exactness checks: compare a context-parallel run against the unpatched single-process model.

Installed as `hf_contextpar.eval`. `oracle` is the one definition of "the same" (tolerances per
dtype and family, the near-tie rule, the kernel-swap bound, digests) that the harness, the
self-test and the test suite read; `compare` holds the per-case metrics. `python -m
hf_contextpar.eval needlebench|bookcorpus` (under torchrun or accelerate launch) is the harness
itself: NeedleBench generation and BookCorpus teacher-forced windows, the unpatched model on one
process versus the patched model on N, with report.json, report.md and plots (`cli`: arguments;
`needlebench_cmd`, `bookcorpus_cmd`: the two runs; `common`: what they share).
"""

from .oracle import first_divergence, logits_diff

__all__ = ["logits_diff", "first_divergence"]
