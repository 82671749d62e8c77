"""PyTorch's own ring attention as a peer row of the benchmark (prefill only).

PyTorch ships ring attention for context parallelism in `torch.distributed.tensor.experimental`
(`_templated_ring_attention`, what `context_parallel` and accelerate's `cp_size` run). Its public
`context_parallel` context manager has no CPU sharding rule, so the peer calls the pieces the way
that context manager does: the input ids and positions are reordered and sharded by PyTorch's own
head-tail load balancer (`_HeadTailLoadBalancer`, `_context_parallel_shard`), every attention layer
runs PyTorch's ring with its rotate method (`set_rotate_method`'s "allgather" or "alltoall") and
the SDPA kernel that returns (out, logsumexp), and the logits come back in order through
`context_parallel_unshard`. GQA is handled exactly as transformers' SDPA path handles it (its own
`use_gqa_in_sdpa` / `repeat_kv`): with no mask it passes `enable_gqa`, so the KV heads travel
unrepeated and the kernel broadcasts them, as under PyTorch CP. The peer has no KV cache and no
decode: it is one prefill forward.

Everything from torch is imported lazily: `unavailable()` says why a build cannot run the peer.
"""

from __future__ import annotations

import contextlib
import time
from contextvars import ContextVar

import torch
import torch.distributed as dist

from ...comm.collectives import CommStats

NAME = "torch_ring"  # the attention implementation the model is switched to while the peer runs
PEERS = {"torch_ring_allgather": "allgather", "torch_ring_alltoall": "alltoall"}  # row name -> rotate method
_MODULE = "torch.distributed.tensor.experimental._attention"
_SYMBOLS = (
    "_templated_ring_attention",
    "_HeadTailLoadBalancer",
    "_context_parallel_shard",
    "context_parallel_unshard",
    "set_rotate_method",
    "_cp_options",
)
_active: ContextVar = ContextVar("hf_contextpar_torch_ring", default=None)


def _torch_cp():
    """PyTorch's context-parallel module, with every symbol the peer uses (ImportError otherwise)."""
    import importlib

    mod = importlib.import_module(_MODULE)
    missing = [s for s in _SYMBOLS if not hasattr(mod, s)]
    if missing:
        raise ImportError(f"{_MODULE} in torch {torch.__version__} lacks {', '.join(missing)}")
    return mod


def unavailable() -> str | None:
    """Why PyTorch's ring cannot run with this torch (a note for the report), or None."""
    try:
        _torch_cp()
    except ImportError as e:
        return f"PyTorch ring attention unavailable: {e}"
    return None


def _ring_module(cp):
    """The module whose globals `_templated_ring_attention` reads (`_create_rotater`)."""
    import sys

    return sys.modules[cp._templated_ring_attention.__module__]


def _kernel(query, key, value, gqa: bool):
    """(op, kwargs): the SDPA kernel returning (out, logsumexp) that SDPA itself would pick here,
    with the arguments PyTorch's CP wrappers pass it. PyTorch CP runs only flash, efficient and
    cuDNN attention; where SDPA would pick the math kernel PyTorch CP raises, and so does the peer."""
    aten = torch.ops.aten
    if query.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu, {}
    choice = torch._fused_sdp_choice(query, key, value, is_causal=True, enable_gqa=gqa)
    backends = torch.nn.attention.SDPBackend
    if choice == backends.FLASH_ATTENTION:
        return aten._scaled_dot_product_flash_attention, {}
    if choice == backends.EFFICIENT_ATTENTION:
        return aten._scaled_dot_product_efficient_attention, dict(attn_bias=None, compute_log_sumexp=True)
    if choice == backends.CUDNN_ATTENTION:
        return aten._scaled_dot_product_cudnn_attention, dict(attn_bias=None, compute_log_sumexp=True)
    raise NotImplementedError(
        f"SDPA picks the {backends(choice).name} kernel for {query.dtype} (GQA {gqa}); PyTorch context "
        "parallelism supports only flash, efficient and cuDNN attention"
    )


def torch_ring_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: what `sdpa_attention_forward` does under PyTorch CP."""
    from transformers.integrations.sdpa_attention import repeat_kv, use_gqa_in_sdpa

    peer = _active.get()
    if peer is None:
        raise RuntimeError(f"the {NAME} attention runs only inside TorchRing.forward")
    if attention_mask is not None or kwargs.get("sliding_window") or kwargs.get("softcap"):
        raise NotImplementedError("PyTorch's ring attention runs causal attention only (no mask, window or softcap)")
    if query.shape[2] != key.shape[2]:
        raise NotImplementedError("PyTorch's ring attention needs a fresh prompt (no KV cache)")
    gqa = False
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:  # transformers' SDPA rule, as is: enable_gqa where it would pass it, else repeated KV heads
        gqa = use_gqa_in_sdpa(attention_mask, key, value)
        if not gqa:
            key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    op, op_kwargs = _kernel(query, key, value, gqa)
    out = peer.cp._templated_ring_attention(
        peer.group, 2, op, query, key, value, is_causal=True, scale=scaling, **op_kwargs
    )[0]
    return out.transpose(1, 2).contiguous(), None


class _TimedRotater:
    """PyTorch's rotater, with the time blocked in `next_buffer` (exposed communication) and the
    K/V payload it sends charged to the peer's CommStats."""

    def __init__(self, inner, stats: CommStats, method: str, world: int):
        self.inner, self.stats, self.method, self.world = inner, stats, method, world
        self.gathered = False

    def exchange_buffers(self, buf):
        nbytes = buf.numel() * buf.element_size()
        if self.method == "alltoall":  # one block to the next rank per step
            self.stats.record("ring_kv", nbytes, nbytes)
        elif not self.gathered:  # one all-gather of every block per layer
            self.stats.record("all_gather_kv", nbytes * (self.world - 1), nbytes * (self.world - 1))
            self.gathered = True
        return self.inner.exchange_buffers(buf)

    def next_buffer(self):
        t0 = time.perf_counter()
        out = self.inner.next_buffer()
        self.stats.add_wait("ring_kv" if self.method == "alltoall" else "all_gather_kv", time.perf_counter() - t0)
        return out


def _group(device):
    """The default process group; on one process, a one-rank gloo group of its own (N = 1 row)."""
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo" if device.type == "cpu" else "nccl", store=dist.HashStore(), rank=0, world_size=1
        )
    return dist.group.WORLD


class TorchRing:
    """PyTorch's ring attention on `model`, one rotate method ("allgather" or "alltoall")."""

    def __init__(self, model, rotate: str, device):
        from torch.distributed.device_mesh import DeviceMesh
        from transformers import AttentionInterface

        self.cp = _torch_cp()
        self.model, self.rotate, self.device = model, rotate, torch.device(device)
        self.group = _group(self.device)
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.mesh = DeviceMesh.from_group(self.group, self.device.type)
        self.stats = CommStats()
        AttentionInterface.register(NAME, torch_ring_attention)

    def shard(self, ids):
        """(balancer, local ids, local positions): PyTorch's head-tail reordering, then this rank's shard."""
        T = ids.shape[1]
        if T % (2 * self.world):
            raise ValueError(
                f"PyTorch's head-tail load balancer needs the prompt length to be a multiple of 2N = "
                f"{2 * self.world} (got {T})"
            )
        balancer = self.cp._HeadTailLoadBalancer(T, self.world, self.device)
        positions = torch.arange(T, device=ids.device).unsqueeze(0).expand_as(ids)
        local_ids, local_pos = self.cp._context_parallel_shard(self.mesh, [ids, positions], [1, 1], balancer)
        return balancer, local_ids, local_pos

    @contextlib.contextmanager
    def _running(self):
        """The model on PyTorch's ring, with this rotate method and load balancing (restored after)."""
        cp, ring = self.cp, _ring_module(self.cp)
        opts = cp._cp_options
        saved = (opts.rotate_method, opts.enable_load_balance, self.model.config._attn_implementation)
        create = ring._create_rotater

        def timed(pg, seq_dim, method=None):
            return _TimedRotater(create(pg, seq_dim, method), self.stats, self.rotate, self.world)

        cp.set_rotate_method(self.rotate)
        opts.enable_load_balance = True
        ring._create_rotater = timed
        self.model.set_attn_implementation(NAME)
        token = _active.set(self)
        try:
            with torch.no_grad():
                yield
        finally:
            _active.reset(token)
            self.model.set_attn_implementation(saved[2])
            ring._create_rotater = create
            opts.rotate_method, opts.enable_load_balance = saved[0], saved[1]

    def first_token(self, ids):
        """The prefill as a user of PyTorch CP runs it: every rank forwards its shard; the rank holding
        the prompt's last position takes the argmax and broadcasts it (our `generate()` equivalent)."""
        balancer, local_ids, local_pos = self.shard(ids)
        where = int((balancer._generate_indices()[0] == ids.shape[1] - 1).nonzero())
        per_rank = ids.shape[1] // self.world
        owner, index = divmod(where, per_rank)
        with self._running():
            out = self.model(
                input_ids=local_ids,
                position_ids=local_pos,
                use_cache=False,
                logits_to_keep=torch.tensor([index], device=ids.device),
            )
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        if self.world > 1:
            dist.broadcast(token, src=dist.get_global_rank(self.group, owner), group=self.group)
        return token

    def logits(self, ids):
        """Every position's logits in the original order, on every rank (`context_parallel_unshard`)."""
        balancer, local_ids, local_pos = self.shard(ids)
        with self._running():
            out = self.model(input_ids=local_ids, position_ids=local_pos, use_cache=False)
        return self.cp.context_parallel_unshard(self.mesh, [out.logits.contiguous()], [1], balancer)[0]
