"""hf-contextpar: exact context-parallel inference for Hugging Face causal LMs.

model = hf_contextpar.apply_context_parallel(model)   # under torchrun / accelerate launch
out = model.generate(**inputs)                          # same tokens as one device
hf_contextpar.remove_context_parallel(model)
"""

from __future__ import annotations

from . import patches  # noqa: F401 (the families: patches/ fills the engine's registry at its import)
from .api import apply_context_parallel, get_runtime, remove_context_parallel
from .cache.sharded import ShardedCache
from .errors import (
    CacheMismatchError,
    CandidateDecodingError,
    ContextParallelError,
    DecodeBatchError,
    HeadsNotDivisibleError,
    PackedSequenceError,
    PatchStateError,
    PeerFailureError,
    RankMismatchError,
    RegistrationError,
    UnsupportedInputError,
    UnsupportedModelError,
)
from .plan.partitions import PartitionTable

__version__ = "0.1.0"
__all__ = [
    "apply_context_parallel",
    "remove_context_parallel",
    "get_runtime",
    "ShardedCache",
    "PartitionTable",
    "ContextParallelError",
    "UnsupportedModelError",
    "HeadsNotDivisibleError",
    "UnsupportedInputError",
    "PackedSequenceError",
    "CandidateDecodingError",
    "DecodeBatchError",
    "CacheMismatchError",
    "RankMismatchError",
    "PeerFailureError",
    "PatchStateError",
    "RegistrationError",
]
