"""The family registry: the engine's side of the family-hook interface, which `patches/` fills.

One registry keyed by `config.model_type` (as Liger-Kernel does). A family lists only what is particular to it
(`FamilyPatch`: a check, an optional reversible patch, the capabilities its layers need, what it needs of the engine
at run time (`FamilyHooks`), the facts the tests and the census use). The engine reads the registry and never imports the families: `hf_contextpar.patches` (the
top-level `patches/` package) registers them when the package face (`hf_contextpar/__init__.py`) is imported, and
declares what the census refused (`INEXACT`, `NOT_CHAINED`, `CENSUS`), which `resolve` and the contract quote.
So the import graph has no circle between the engine and the families: patches/ imports the engine, never back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from transformers.cache_utils import DynamicCache

from ..errors import RegistrationError, UnsupportedModelError


class FamilyHooks:
    """What a family needs of the engine that its config does not say: the one interface through which the engine
    asks for family-particular behaviour (it never names a family, nor carries a flag for one). The defaults are what
    every family gets; `patches/` subclasses it for a family that needs otherwise and sets the subclass's instance
    as its entry's `hooks`. A new family need is a method here with the general behaviour as its default, and its
    override in patches/."""

    def check_mask(self, model, mask, num_new: int) -> None:
        """Before any collective: refuse a caller's 2D attention mask (B, columns) this family cannot take for
        `num_new` input tokens (the contract's other mask checks have run)."""

    def chained_mask(self, mask, start: int, end: int):
        """The 2D mask a chained rank's forward gets, its own tokens being the mask's columns [start, end):
        everything up to its partition's end, as in a chunked prefill (transformers' recurrent mixers take their
        padding from the mask's last columns)."""
        return mask[:, :end]

    def attends_window(self, cache_window: int, attention_window) -> bool:
        """May a layer whose cache keeps a sliding window of `cache_window` tokens attend with `attention_window`
        (None: no window)? Only with that window: a cache and an attention that disagree are a cache made for
        another config (the adapter's CacheMismatchError)."""
        return attention_window == cache_window

    def kv_source(self, module) -> int | None:
        """The cache layer whose K/V attention module `module` (with a layer index of its own) attends, where that
        is not its own layer (KV shared across layers: Gemma 3n's and Gemma 4's "reuse" layers); None: its own. The
        adapter checks that those are exactly the K/V that layer's update returned in the forward."""
        return None

    def cache_copies(self, config) -> tuple:
        """The cache layers a forward of this config adds after the config's own, as copies of these layers (by index,
        in order): Dory's recurrent loops after the first each write their K/V to a copy of the loop's layers. The
        sharded cache makes them up front, each sharded like its layer, so the model finds them and adds none."""
        return ()

    def looped(self, module) -> bool:
        """Does attention module `module` run more than once per forward, each run attending the cache layer its
        update just wrote (its own, then a copy: `cache_copies`)? Then each call is counted as that cache layer's."""
        return False

    def indexed_layer_type(self) -> str:
        """The `layer_types` name of an indexed-attention family's layers with an indexer (attention/indexed.py):
        transformers' own ("indexed_attention") unless the family names its kind otherwise."""
        return "indexed_attention"

    def tensor_parallel(self) -> str | None:
        """Why the family's attention cannot run with its heads split over tensor-parallel ranks, refused at apply
        (mesh.check); None: it runs as any family's, each TP rank attending with the heads it holds."""
        return None

    def selected_blocks(self, module, kwargs: dict):
        """An indexed-attention layer that hands its top-k as blocks of key columns (a block indexer's selection,
        counted from column 0) rather than as `indices=`: (its (B, H, Tq, k) block numbers, -1 for an unused slot, one
        selection per KV head or one for all; the blocks' width in columns), read from the keyword arguments of its
        attention call; None: it hands none."""
        return None

    def selection(self, module, attention_mask, indexer_mask):
        """An indexed-attention layer that hands its top-k otherwise than as `indices=`: its (B, Tq, T) bool
        selection read from what it passed as `attention_mask` (the mask function gave it `indexer_mask`), else
        None (the attention_mask is then checked as any layer's)."""
        return None

    def cache(self, config):
        """The transformers cache whose layers the model keeps its K/V and states in, which the sharded cache mirrors:
        the one it makes when given none. A family that keeps its states outside the Cache API (RWKV's `state` list)
        names the layers its patch runs them through under context parallelism."""
        return DynamicCache(config=config)

    def finish(self, output, cache) -> None:
        """After a forward with a cache, once that cache holds the same final states on every rank (a chained
        prefill's after their broadcast): what the family's output carries of them outside the cache (RWKV returns its
        states in `state`). The output is this rank's, before its logits are gathered."""


DEFAULT_HOOKS = FamilyHooks()


@dataclass(frozen=True)
class FamilyPatch:
    model_type: str
    description: str
    check: Callable | None = None  # check(config) raises UnsupportedModelError
    apply: Callable | None = None  # apply(model) -> undo(); for families that need more than the generic hook
    tiny: dict | None = None  # config overrides for the family's tiny random model (the exactness matrix)
    reference_attn: str = "sdpa"  # the stock attention implementation exactness is measured against
    fp64_tolerance: float = 1e-10  # larger only where transformers' own fp64 reference is fp32-limited
    fp32_tolerance: float = 1e-4  # larger only where the unpatched fp32 model is itself that far from fp64
    census: bool = False  # an entry of the census's verified list (verified.py), not written by hand
    recurrent: bool = False  # its recurrent layers' mixers continue from a passed state: the chain runs them
    # indexed attention (DSA): its indexer's keys go through cache.update_indexer and its attention takes the top-k
    # as `indices=`, so every rank's indexer scores every column (hf_contextpar/attention/indexed.py)
    indexed: bool = False
    csa: bool = True  # sparse=CSA(...) defined for its attention (False: its layers attend otherwise, CSA refused)
    compressed: bool = False  # DeepSeek-V4's CSA / HCA: cache layers of its own (patches/deepseek_v4.py)
    hooks: FamilyHooks = DEFAULT_HOOKS  # what it needs of the engine beyond its config (FamilyHooks)


REGISTRY: dict[str, FamilyPatch] = {}
BUILTIN: set[str] = set()  # the families patches/ registers (`seal`): register() may not replace them

# what patches/ declares about the families it does not register (filled at its import)
INEXACT: dict[str, str] = {}  # model_type -> why it cannot run exact under CP, registered or not
NOT_CHAINED: dict[str, str] = {}  # hybrid model_type -> why its recurrent layers cannot pass their states
CENSUS: dict = {}  # the census's record: "transformers" (its version), "not_verified" (model_type -> what it found)


def register(patch: FamilyPatch) -> FamilyPatch:
    """Add a family the library does not know (or replace one you added). Users can register a family they have
    verified themselves. A family the library already lists is refused: an entry of yours would drop its patch,
    check and tolerances (Opt's left-padding patch, a hybrid's state chain), silently changing its results."""
    if patch.model_type in BUILTIN:
        raise RegistrationError(
            f"model_type '{patch.model_type}' is already in hf-contextpar's registry (verified, with what it needs: "
            f"{REGISTRY[patch.model_type].description}); it runs with apply_context_parallel(model) alone. "
            "Registering it again would replace that entry and drop its patch or checks: remove the register() "
            "call."
        )
    return add(patch)


def add(patch: FamilyPatch) -> FamilyPatch:
    REGISTRY[patch.model_type] = patch
    return patch


def seal() -> None:
    """patches/'s entries are the library's: a user's register() of one is refused (it would drop their patch)."""
    BUILTIN.update(REGISTRY)


def hooks_of(config) -> FamilyHooks:
    """The family hooks the engine runs a model of this config with (the defaults for a family with none)."""
    patch = REGISTRY.get(config.model_type)
    return patch.hooks if patch is not None else DEFAULT_HOOKS


def refuse_inexact(config) -> None:
    """A family the census found cannot run exact, refused with its own reason, registered or not: checked first at
    apply, since its structure may also trip a generic check whose message would not say what blocks it."""
    if config.model_type in INEXACT:
        raise UnsupportedModelError(
            f"model_type '{config.model_type}' cannot run under context parallelism with hf-contextpar, registered or "
            f"not: {INEXACT[config.model_type]}."
        )


def resolve(config) -> FamilyPatch:
    """The registry entry for a config, after its family check; a clear error if there is none."""
    mt = config.model_type
    refuse_inexact(config)
    patch = REGISTRY.get(mt)
    if patch is None:
        found = (CENSUS.get("not_verified", {}).get(mt) or "").rstrip(".")
        census = f"the model census of transformers {CENSUS.get('transformers', '?')} (docs/census.md)"
        if found.startswith("refused"):  # opted in, the library refuses it: registering changes nothing
            raise UnsupportedModelError(
                f"model_type '{mt}' is not supported by hf-contextpar: {census} found it {found}. It cannot run "
                "under context parallelism with this version."
            )
        why = f"{census} did not verify it ({found})" if found else f"it is not in {census} (a newer model type)"
        raise UnsupportedModelError(
            f"model_type '{mt}' is not supported by hf-contextpar: {why}. A family runs with no opt-in once the "
            f"census verifies it exact at N = 2, 3, 4. To check it yourself, in a clone of the hf-contextpar "
            f"repository (the census is a study, not installed): torchrun --nproc_per_node 2 -m dev.census --families {mt} --json census.json, then the same with --sweep at "
            f"--nproc_per_node 2, 3 and 4; if every run is exact, opt in with "
            f"hf_contextpar.patches.register(FamilyPatch('{mt}', '<description>'))."
        )
    if patch.check is not None:
        patch.check(config)
    return patch
