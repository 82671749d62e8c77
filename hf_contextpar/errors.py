"""Errors raised by hf-contextpar. Each message says what to do; each kind has its own type, so a
caller (and the tests) can tell a refusal of the model from one of an input, a cache, a peer."""


class ContextParallelError(RuntimeError):
    """Misuse or failure of a context-parallel run (bad input, a peer that died, ...)."""


class UnsupportedModelError(ContextParallelError, ValueError):
    """The model, or a feature it uses, cannot run exactly under context parallelism."""


class HeadsNotDivisibleError(UnsupportedModelError):
    """strategy="ulysses" where the heads cannot be split over the ranks: N does not divide the query and KV
    head counts, the layer caches one latent for all heads (MLA), or it expands its cached K/V across heads."""


class UnsupportedInputError(ContextParallelError, ValueError):
    """An input of a forward or of generate() that the plan cannot reproduce exactly."""


class PackedSequenceError(UnsupportedInputError):
    """position_ids that restart inside a row (packed documents, a block-diagonal mask)."""


class CandidateDecodingError(UnsupportedInputError):
    """Assisted or prompt-lookup decoding from inputs_embeds."""


class DecodeBatchError(UnsupportedInputError):
    """decode="ring_pass_q" with fewer sequences than ranks."""


class CacheMismatchError(ContextParallelError, ValueError):
    """A cache that cannot serve this call: it does not fit the input (its batch, its length against
    the mask) or the group, it is not one context parallelism can use (a static, quantized, offloaded
    or already filled stock cache), a crop reaches keys its sliding layers already dropped, or assisted /
    prompt-lookup decoding would feed the whole sequence again on top of a cache that holds tokens."""


class RankMismatchError(ContextParallelError):
    """Ranks got different inputs, settings or models, or ended with different outputs."""


class PeerFailureError(ContextParallelError):
    """A peer rank failed or did not answer within the timeout."""


class PatchStateError(ContextParallelError):
    """The patched model used in a state the patch does not allow (applied twice, deep-copied,
    its attention implementation changed after apply, a ShardedCache used after removal)."""


class RegistrationError(ContextParallelError, ValueError):
    """patches.register() of a family hf-contextpar already registers (its entry, with its patch, would be lost)."""
