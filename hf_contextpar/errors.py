"""Errors raised by hf-contextpar. Each message says what to do."""


class ContextParallelError(RuntimeError):
    """Misuse or failure of a context-parallel run (bad input, a peer that died, ...)."""


class UnsupportedModelError(ContextParallelError, ValueError):
    """The model, or a feature it uses, cannot run exactly under context parallelism."""
