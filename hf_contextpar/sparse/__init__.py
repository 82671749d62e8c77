"""Approximate modes, opt in only: CSPS's communication-efficient sparse attention (`CSA`).

Never chosen by strategy="auto" and never on unless asked; a patched model's runtime says when a
forward ran approximate (`get_runtime(model).approximate`), and `hf_contextpar.eval.csa_reference` runs the same
definition on one process, the sparse path's own exactness check.
"""

from .csa import CSA

__all__ = ["CSA"]
