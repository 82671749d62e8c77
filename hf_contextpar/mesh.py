"""Tensor parallelism inside a node x context parallelism across nodes: one 2-D device mesh.

    model, cp_group, tp_group = load_tp_cp(path, tp=2, dtype=torch.bfloat16)
    apply_context_parallel(model, group=cp_group)

The mesh is (cp, tp) with TP the inner dimension: ranks r = c * tp + t, so each TP group is tp
consecutive ranks (one node's GPUs under torchrun) and each CP group takes one rank of every TP
group. The weights are sharded by transformers' own TP plan for the model (`base_model_tp_plan`,
as `from_pretrained(distributed_config=DistributedConfig(tp_size=...))` applies it) and read from
the checkpoint already sharded: each rank reads only its slices, the whole model is never built on
any rank. transformers 5.24 builds its own device mesh over the whole world (pp x dp x fsdp x tp
must equal WORLD_SIZE) and ignores a `device_mesh` argument; `from_pretrained` here runs with the
TP sub-mesh of our (cp, tp) mesh in its place (`_tp_submesh`), everything else as transformers does it.
Every TP rank then holds heads / tp query heads and kv_heads / tp KV heads of each layer, which the
library reads (`tensor_parallel`), and context parallelism runs over the CP group unchanged.

Where tp exceeds the KV heads (vLLM's DCP), the dcp = tp / kv_heads TP ranks that would each hold a
copy of one KV head hold it whole instead (the plan's k/v projections are loaded replicated and cut to
that head: transformers' `colwise` would split the head), and each keeps every dcp-th slot of its CP
rank's tokens of it in its cache (`cache.ShardLayout.held`); attention gathers the group's query heads
and merges the partials by LSE (attention/__init__.py), so the cache is split cp x dcp ways.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .comm.group import resolve_group
from .config import config_value
from .errors import ContextParallelError, HeadsNotDivisibleError, UnsupportedModelError

MESH_DIMS = ("cp", "pp", "dp_replicate", "fsdp", "tp")  # transformers reads pp, fsdp and tp from it


def tensor_parallel(model) -> tuple[object, int]:
    """(the TP process group, its size) of a model whose weights are DTensors on a 1-D mesh (transformers'
    tensor parallelism), else (None, 1)."""
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            if mesh.ndim != 1:
                raise UnsupportedModelError(
                    f"the model's weights are sharded over a {mesh.ndim}-D device mesh; hf-contextpar runs with "
                    "tensor parallelism on one mesh dimension (load with hf_contextpar.mesh.load_tp_cp)."
                )
            return (mesh.get_group(), mesh.size()) if mesh.size() > 1 else (None, 1)
    return None, 1


def check_cp_group(group, tp_group) -> None:
    """The CP group of a TP model must hold one rank of each TP group: TP peers run the same tokens
    (their all-reduces add partial sums of them), so no two of them may share a CP group."""
    if group is None or tp_group is None:
        return
    shared = set(dist.get_process_group_ranks(group)) & set(dist.get_process_group_ranks(tp_group))
    if len(shared) > 1:
        raise UnsupportedModelError(
            f"the model is tensor-parallel over ranks {sorted(dist.get_process_group_ranks(tp_group))} and the "
            f"context-parallel group holds {len(shared)} of them ({sorted(shared)}); TP peers must process the same "
            "tokens. Pass the CP group of the mesh: apply_context_parallel(model, group=cp_group) with cp_group "
            "from hf_contextpar.mesh.load_tp_cp (or build_mesh)."
        )


def check(facts) -> int:
    """At apply (capabilities.py): the TP ranks of each CP rank (1: none), after refusing a family whose attention
    cannot split its heads over them (`FamilyHooks.tensor_parallel`: MiniMax-M3's block indexer selects per KV head
    of the whole model)."""
    why = facts.hooks.tensor_parallel() if facts.tp > 1 else None
    if why is not None:
        raise UnsupportedModelError(
            f"tensor parallelism (tp={facts.tp}) is not supported on {facts.config.model_type}: {why}. Load it with "
            "tp=1 and use more context-parallel ranks."
        )
    return facts.tp


def check_tp_heads(config, tp: int) -> int:
    """Each TP rank must hold whole heads: tp must divide the query heads, and divide or be a multiple of
    the KV heads. Returns dcp: the TP ranks sharing one KV head (1: tp divides the KV heads)."""
    text = config.get_text_config(decoder=True)
    heads = config_value(text, "num_attention_heads")
    kv = config_value(text, "num_key_value_heads") or heads
    if heads is None or heads % tp or (kv % tp and tp % kv):
        raise HeadsNotDivisibleError(
            f"tensor parallelism over {tp} ranks splits every layer's heads, but this model has {heads} query and "
            f"{kv} KV heads: {tp} must divide the query heads and divide the KV heads or be a multiple of them "
            "(then the TP ranks sharing a KV head hold sequence shards of it, DCP). Use such a tp, and more "
            "context-parallel ranks instead."
        )
    return max(1, tp // kv)


DCP_ATTR = "hf_contextpar_dcp"
KV_PROJECTIONS = ("k_proj", "v_proj")


def dcp_of(model):
    """(group, index, size) of this rank's DCP group where load_tp_cp loaded the model with tp > KV heads: the
    TP ranks holding the same KV head, each storing every size-th token of it; None otherwise."""
    return getattr(model, DCP_ATTR, None)


def _dcp_plan(config, dcp: int) -> dict:
    """The TP plan override for DCP: the k/v projections loaded whole (cut to one head after the load)."""
    text = config.get_text_config(decoder=True)
    plan = dict(getattr(text, "base_model_tp_plan", None) or {})
    keys = [k for k, style in plan.items() if k.rsplit(".", 1)[-1] in KV_PROJECTIONS and style == "colwise"]
    if len(keys) != len(KV_PROJECTIONS):
        raise HeadsNotDivisibleError(
            f"tp is {dcp}x this model's KV heads, which needs DCP (the TP ranks sharing a KV head holding sequence "
            "shards of it), and hf-contextpar runs DCP on TP plans with separate colwise k_proj / v_proj only; "
            f"{type(text).__name__}'s plan has {sorted(k for k in plan if 'proj' in k)}. Use a tp that divides "
            "the KV heads, and more context-parallel ranks instead."
        )
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    prefix = getattr(MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None), "base_model_prefix", "model")
    return {f"{prefix}.{k}": "replicate" for k in keys}


def _keep_kv_head(model, config, tp_rank: int, dcp: int) -> None:
    """Cut every layer's (replicated) k/v projection to the KV head this TP rank's query heads attend:
    head tp_rank // dcp, the one transformers' colwise q shard pairs with under GQA."""
    text = config.get_text_config(decoder=True)
    head_dim = config_value(text, "head_dim") or text.hidden_size // text.num_attention_heads
    rows = slice((tp_rank // dcp) * head_dim, (tp_rank // dcp + 1) * head_dim)
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in KV_PROJECTIONS and isinstance(module, torch.nn.Linear):
            module.weight = torch.nn.Parameter(module.weight.data[rows].clone(), requires_grad=False)
            if module.bias is not None:
                module.bias = torch.nn.Parameter(module.bias.data[rows].clone(), requires_grad=False)
            module.out_features = head_dim


def _dcp_groups(tp: int, dcp: int):
    """Every rank's DCP group (dcp consecutive ranks of one TP group: the TP ranks of one KV head); every
    rank of the world makes all of them, in one order. (group, index, size) for this rank."""
    rank, world, mine = dist.get_rank(), dist.get_world_size(), None
    for start in range(0, world, dcp):
        group = dist.new_group(list(range(start, start + dcp)))
        if start <= rank < start + dcp:
            mine = (group, rank - start, dcp)
    return mine


def init_world(device_type: str = "cpu") -> None:
    """The default process group, from the torchrun / accelerate environment (gloo on CPU, nccl on
    CUDA), unless one exists; one hf-contextpar made is destroyed at exit (comm/group.py)."""
    resolve_group(None, device=torch.device(device_type))
    if not dist.is_initialized():
        raise ContextParallelError(
            "tensor x context parallelism needs several processes: launch with torchrun or accelerate."
        )


def build_mesh(tp: int, device_type: str = "cpu"):
    """The (cp, 1, 1, 1, tp) device mesh over the whole world (initialising the default group from the
    torchrun environment if nobody has): (mesh, cp_group, tp_group)."""
    from torch.distributed.device_mesh import init_device_mesh

    init_world(device_type)
    world = dist.get_world_size()
    if tp < 1 or world % tp:
        raise ContextParallelError(f"tp={tp} must divide the number of processes ({world}).")
    mesh = init_device_mesh(device_type, (world // tp, 1, 1, 1, tp), mesh_dim_names=MESH_DIMS)
    return mesh, mesh["cp"].get_group(), mesh["tp"].get_group()


@contextlib.contextmanager
def _tp_submesh(mesh, device):
    """transformers' mesh factory, for the duration of one from_pretrained, returning our mesh: TP over
    its `tp` dimension (the ranks of one TP group), pp / dp / fsdp of size 1."""
    from transformers.distributed import mixin
    from transformers.distributed.utils import TransformersDeviceMesh

    original = mixin.initialize_distributed_mesh

    def ours(distributed_config):
        if (
            distributed_config.tp_size != mesh["tp"].size()
            or distributed_config.dp_size * distributed_config.pp_size > 1
        ):
            raise ValueError(f"_tp_submesh serves tensor parallelism over {mesh['tp'].size()} ranks only.")
        return device, TransformersDeviceMesh(mesh, mesh)  # no expert mesh: ep_size stays 1

    mixin.initialize_distributed_mesh = ours
    try:
        yield
    finally:
        mixin.initialize_distributed_mesh = original


def load_tp_cp(path: str, tp: int, dtype=torch.float32, device: torch.device | None = None, **kwargs):
    """A causal LM from `path` (a local directory or hub id) over the (cp, tp) mesh, its weights read
    already sharded by transformers' TP plan: (model, cp_group, tp_group). Every rank calls it.
    Pass cp_group to apply_context_parallel."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    device = device or torch.device("cpu")
    config = AutoConfig.from_pretrained(path, trust_remote_code=kwargs.get("trust_remote_code", False))
    dcp = check_tp_heads(config, tp)
    overrides = _dcp_plan(config, dcp) if dcp > 1 else None
    mesh, cp_group, tp_group = build_mesh(tp, device.type)
    if tp == 1:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).to(device)
        return model.eval(), cp_group, None
    with _tp_submesh(mesh, device):
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, distributed_config=DistributedConfig(tp_size=tp, tp_plan=overrides), **kwargs
        )
    got, size = tensor_parallel(model)
    if size != tp:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no tensor-parallel plan that shards its weights (transformers' "
            "base_model_tp_plan); it cannot run with tp > 1."
        )
    if dcp > 1:
        _keep_kv_head(model, config, mesh["tp"].get_local_rank(), dcp)
        setattr(model, DCP_ATTR, _dcp_groups(tp, dcp))
    return model.eval(), cp_group, tp_group


def local_numel(t: torch.Tensor) -> int:
    """Elements this rank holds of a weight (its shard, for a DTensor)."""
    from torch.distributed.tensor import DTensor

    return t.to_local().numel() if isinstance(t, DTensor) else t.numel()


PROBE = "hf_contextpar_heads_probe"


def heads_per_rank(model) -> tuple[int, int] | None:
    """(query heads, KV heads) this rank's attention receives under tensor parallelism: what the
    model's TP plan leaves each rank, read from one 1-token forward of the unpatched model through a
    probe attention (a plan may shard the heads, `colwise`, or gather them back, e.g. phi3's fused
    QKV `colwise_gather_output`, so neither the config nor a weight's shard says it). Collective over
    the TP group: every rank of it calls this. None where no attention call reached the probe."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    seen = []

    def probe(module, query, key, value, attention_mask, **kwargs):
        seen.append((query.shape[1], key.shape[1]))
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None

    AttentionInterface.register(PROBE, probe)
    # the mask SDPA gets: a model that reads its 4D mask itself (Qwen4-Exp's QSA indexer) runs its 1-token forward
    AttentionMaskInterface.register(PROBE, AttentionMaskInterface._global_mapping["sdpa"])
    original = model.config._attn_implementation
    device = next(model.parameters()).device
    model.set_attn_implementation(PROBE)
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
    finally:
        model.set_attn_implementation(original)
    return seen[0] if seen else None
