"""Kernel dispatch: local attention of one query block against one key block, returning (out, LSE).

Masks come from *global* token columns (`masks`), never from SDPA's top-left `is_causal` on a
sharded query: key column c is visible to query column q iff c <= q, q - c < window (sliding
layers) or c is in q's chunk (chunked layers), and the key is not padding. Sub-blocks whose mask is trivial (all visible, none visible, or
the square causal diagonal that head-tail sharding produces) go to the fused kernel without a
mask; only genuinely irregular blocks pay for an explicit bias.

Nothing here is O(Tq * Tk): an irregular block (a sliding window, padding, soft-capping) is done
in tiles of query rows, each against only the keys its rows can see, cut at the window's edges
into the keys every row sees, the causal diagonal and a narrow band; the first two go to the
fused kernel unmasked, and a mask is built for one tile's band at a time. A whole-sequence
block (Ulysses) therefore costs the same memory per token as a ring block.

Kernels: PyTorch's CPU flash kernel and, on CUDA, the cuDNN / flash / memory-efficient kernels, all
of which return the LSE. Soft-capped logits (Gemma2) and dtypes a kernel lacks use a plain math
path. Outputs are in the accumulation dtype (fp32, or fp64 for fp64 models).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .bias import ScoreBias
from .masks import classify, key_segments, runs, span, visible, within
from .merge import Accumulator

_MAX_RUNS = 4  # split a block into contiguous sub-blocks when each side has at most this many runs
_TILE_ELEMS = 1 << 22  # cap, in elements, on one tile's mask (B, 1, rows, keys) or math-path scores (B, H, rows, keys)
_MIN_WINDOW_ROWS = 64  # with a tiny window, tiles of fewer rows would only add kernel calls


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _math(q, k, v, vis, scale, softcap, extra=None):
    """Reference path: explicit scores in the accumulation dtype. vis: bool, broadcastable to scores; extra: a score
    bias (attention/bias.py) added after the scaling and soft-cap, or None."""
    acc = acc_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    k = k.to(acc).repeat_interleave(group, dim=1)
    v = v.to(acc).repeat_interleave(group, dim=1)
    s = torch.matmul(q.to(acc), k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if extra is not None:
        s = s + extra.to(acc)
    if vis is not None:
        s = s.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1))
    return torch.matmul(p, v), lse


def _fused(q, k, v, bias, is_causal, scale):
    """One fused-kernel call; returns (out, lse) or None when no fused kernel fits.

    A block every query row sees whole (no mask, not causal) runs with the query heads of each KV
    group folded into rows, q (B, H, Tq, D) -> (B, Hkv, group*Tq, D): rows are independent there,
    so this is the same attention, but each KV head is streamed once per group instead of once
    per query head (decode at 8K keys, 8 heads per KV head: about 4x faster on CPU) and CUDA
    never repeats K/V heads. Causal and masked blocks keep one query head per row block.
    """
    group = q.shape[1] // k.shape[1]
    if group > 1 and bias is None and not is_causal:
        b, h, t, d = q.shape
        res = _fused(q.reshape(b, k.shape[1], group * t, d), k, v, None, False, scale)
        if res is None:
            return None
        return res[0].reshape(b, h, t, res[0].shape[-1]), res[1].reshape(b, h, t)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=bias, scale=scale
        )
        return out, lse
    if q.device.type == "cuda":
        return _cuda_fused(q, k, v, bias, is_causal, scale)
    return None


# CUDA: the fused kernels that return the LSE, in the order tried. cuDNN's and flash take fp16/bf16
# without a bias; the memory-efficient kernel takes any dtype and a bias. Each is checked against the
# math path once per dtype (`cuda_kernels`), with GQA passed natively where it gives the right answer,
# else with K/V heads repeated locally (a block already received; nothing repeated goes over the wire).
# cuDNN builds a graph for every new shape (42-60 ms on an H200, the first one 0.5 s), then runs big
# blocks about 1.9x faster than flash (8K x 8K bf16, 32/8 heads of 128: 1.63 against 3.10 ms) and
# small ones no faster (decode: 0.05-0.10 against 0.08 ms). From 2^26 scores a block saves more than
# its build within one 32-layer forward; smaller blocks (decode, short prompts) run flash.
_CUDA_KERNELS = ("cudnn", "flash", "efficient")
_CUDNN_MIN_SCORES = 1 << 26  # query rows x keys
_cuda_modes: dict[tuple[str, torch.dtype], str | None] = {}  # (kernel, dtype) -> "native" | "repeat" | None
_cuda_refused: set[tuple] = set()  # (kernel, dtype, qk dim, v dim) a checked kernel refused at run time


def _cuda_call(name, q, k, v, bias, is_causal, scale):
    ops = torch.ops.aten
    if name == "cudnn":
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        res = ops._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, is_causal, False, scale=scale)
    elif name == "flash":
        res = ops._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
    else:
        if bias is not None:
            bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        res = ops._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, is_causal, scale=scale)
    lse = res[1].reshape(*res[1].shape[:3])[..., : q.shape[2]]  # cuDNN's is (B, H, Tq, 1), efficient's padded
    return res[0], lse


def _cuda_run(name, mode, q, k, v, bias, is_causal, scale):
    group = q.shape[1] // k.shape[1]
    if group > 1 and mode == "repeat":
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return _cuda_call(name, q, k, v, bias, is_causal, scale)


def _cuda_fused(q, k, v, bias, is_causal, scale):
    low = q.dtype in (torch.float16, torch.bfloat16)
    for name, mode in cuda_kernels(q.dtype, q.device).items():  # checked once per dtype, in _CUDA_KERNELS order
        if name != "efficient" and (bias is not None or not low):
            continue
        if name == "cudnn" and q.shape[2] * k.shape[2] < _CUDNN_MIN_SCORES:
            continue
        shape_key = (name, q.dtype, q.shape[-1], v.shape[-1])
        if shape_key in _cuda_refused:
            continue
        try:
            return _cuda_run(name, mode, q, k, v, bias, is_causal, scale)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:  # a head size or layout this kernel does not take: the next one, for good
            _cuda_refused.add(shape_key)
    return None


def cuda_kernels(dtype, device) -> dict[str, str]:
    """The fused CUDA kernels usable for dtype, each with its GQA mode, checked once against the math
    path (causal, and under a padding bias for the memory-efficient kernel); a kernel that raises or
    disagrees is left out, and blocks no kernel takes run the math path."""
    for name in _CUDA_KERNELS:
        if (name, dtype) not in _cuda_modes:
            _cuda_modes[name, dtype] = _check_cuda_kernel(name, dtype, device)
    return {name: _cuda_modes[name, dtype] for name in _CUDA_KERNELS if _cuda_modes[name, dtype]}


def _check_cuda_kernel(name, dtype, device) -> str | None:
    if dtype not in (torch.float16, torch.bfloat16, torch.float32) or (name != "efficient" and dtype == torch.float32):
        return None
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, h, 40, 64, generator=g).to(device, dtype) for h in (4, 2, 2))
    vis = torch.rand(1, 1, 40, 40, generator=g).to(device) > 0.3
    vis[..., 0] = True
    cases = [(None, True, torch.ones(40, 40, dtype=torch.bool, device=device).tril())]
    if name == "efficient":
        cases.append((_bias(vis, dtype), False, vis))
    tol = 1e-2 if dtype != torch.float32 else 1e-4
    for mode in ("native", "repeat"):
        try:
            ok = True
            for bias, causal, m in cases:
                o1, l1 = _cuda_run(name, mode, q, k, v, bias, causal, 0.125)
                o2, l2 = _math(q, k, v, m, 0.125, None)
                ok &= bool((o1.float() - o2.float()).abs().max() < tol and (l1.float() - l2.float()).abs().max() < tol)
        except RuntimeError:
            ok = False
        if ok:
            return mode
    return None


def cuda_kernel_ok(dtype, device) -> bool:
    """Whether some fused CUDA kernel passed its check for dtype (else every block runs the math path)."""
    return bool(cuda_kernels(dtype, device))


def _bias(vis, dtype, extra=None):
    """The additive mask (0 visible, -inf not) of vis, plus a score bias `extra` where there is one. On CUDA its rows
    are allocated at a multiple of 16 elements and sliced back: the memory-efficient kernel needs the bias's strides
    16-byte aligned."""
    keys = vis.shape[-1]
    width = -(-keys // 16) * 16 if vis.device.type == "cuda" else keys
    shape = vis.shape[:-1] if extra is None else torch.broadcast_shapes(vis.shape[:-1], extra.shape[:-1])
    bias = torch.zeros(*shape, width, dtype=dtype, device=vis.device)[..., :keys]
    if extra is not None:
        bias.add_(extra)
    return bias.masked_fill_(~vis, -math.inf)


@dataclass(frozen=True)
class Rule:
    """How one layer scores its keys: the softmax scale, the soft-cap (Gemma2), the window
    (None, a sliding window's width, or `masks.Chunked`) and a score bias from global columns (`bias.ScoreBias`:
    ALiBi, a relative-position bias), the same for every block of the layer."""

    scale: float
    window: object = None
    softcap: float | None = None
    bias: ScoreBias | None = None

    def extra(self, q, q_cols, keys: Keys):
        """The score bias of one tile (None without one)."""
        return None if self.bias is None else self.bias.block(q_cols, keys.cols, q.dtype, q.device, keys.v)


@dataclass(frozen=True)
class Keys:
    """One block of keys: k, v (B, Hkv, Tk, D), their global columns (Tk,) and which are real (B, Tk) or None."""

    k: torch.Tensor
    v: torch.Tensor
    cols: torch.Tensor
    valid: torch.Tensor | None = None

    def part(self, a: int, b: int) -> Keys:
        """Keys a..b of the block."""
        valid = self.valid[:, a:b] if self.valid is not None else None
        return Keys(self.k[:, :, a:b], self.v[:, :, a:b], self.cols[a:b], valid)


def _block(acc, r0, q, q_cols, keys: Keys, rule: Rule, *, tile=False, kind=None):
    """One block with an arbitrary mask, its (out, lse) merged into acc's rows from r0 (nothing if no key is visible).

    A trivially masked block goes to the fused kernel in one call. Any other is done in row tiles
    (`_tiled`), or, when it already is one tile (`tile=True`), under its explicit (rows, keys) mask.
    kind: the block's `masks.classify`, where the caller has it already.
    """
    kind = kind or classify(q_cols, keys.cols, rule.window)
    if kind == "none":
        return
    if keys.valid is not None and bool(keys.valid.all()):
        keys = Keys(keys.k, keys.v, keys.cols)
    if rule.softcap is None and rule.bias is None and keys.valid is None and kind in ("all", "causal"):
        res = _fused(q, keys.k, keys.v, None, kind == "causal", rule.scale)
        if res is not None:
            t = acc_dtype(q.dtype)
            out, lse = (x if x.dtype == t else x.to(t) for x in res)  # no cast op where it is t already
            acc.add(out, lse, r0)
            return
    if not tile:
        _tiled(acc, r0, q, q_cols, keys, rule)
        return
    vis = visible(q_cols, keys.cols, rule.window, q.device)[:, None]  # (1 or B, 1, rows, keys)
    if keys.valid is not None:
        vis = vis & keys.valid[:, None, None, :]  # (B, 1, rows, keys): shared by all heads
    acc.add(*_masked(q, keys.k, keys.v, vis, rule, rule.extra(q, q_cols, keys)), r0)


def _rows_per_tile(q, n_keys, window, rule: Rule):
    """Query rows per tile, so that one tile's mask (B, 1, rows, keys), or its scores (B, H, rows, keys) on the
    soft-capping math path or under a score bias, stays under _TILE_ELEMS elements. With a window a tile of r rows
    sees at most r + window - 1 keys; tiles of a quarter window keep its masked band (r x r) small next to the
    unmasked rest."""
    per_head = rule.softcap is not None or rule.bias is not None
    per_row = q.shape[0] * (q.shape[1] if per_head else 1)
    window = span(window)
    if window is None:
        return max(1, _TILE_ELEMS // (per_row * n_keys))
    rows = max(window // 4, _MIN_WINDOW_ROWS)
    while rows > 1 and per_row * rows * min(n_keys, rows + window - 1) > _TILE_ELEMS:
        rows //= 2
    return rows


def _tiled(acc, r0, q, q_cols, keys: Keys, rule: Rule):
    """An irregular block in tiles of query rows (cut at breaks in q_cols, so a tile's columns are
    usually contiguous), each against only the keys it can see, segment by segment
    (`masks.key_segments`): the segments every row sees and the square diagonal run fused and
    unmasked; the rest gets a mask of one tile's size. Partials merge into acc by LSE, as ring blocks do."""
    rows = _rows_per_tile(q, keys.cols.numel(), rule.window, rule)
    spans = runs(q_cols)
    if len(spans) > _MAX_RUNS:  # scattered rows: tiles need not be contiguous, only small
        spans = [(0, q.shape[2])]
    for qa, qb in spans:
        for t0 in range(qa, qb, rows):
            t1 = min(t0 + rows, qb)
            qt, qc = q[:, :, t0:t1], q_cols[t0:t1]
            for ka, kb in key_segments(qc, keys.cols, rule.window):
                _block(acc, r0 + t0, qt, qc, keys.part(ka, kb), rule, tile=True)


def _masked(q, k, v, vis, rule: Rule, extra=None):
    """Attention under an explicit mask vis (B or 1, 1, Tq, Tk) and score bias `extra` (`Rule.extra`, or None), a
    tile's worth: callers bound its size."""
    acc = acc_dtype(q.dtype)
    if rule.softcap is None:
        res = _fused(q, k, v, _bias(vis, q.dtype, extra), False, rule.scale)
        if res is not None:  # fused kernels report lse 0 for rows that saw nothing: make those -inf, out 0
            seen = vis.any(-1)
            return res[0].to(acc).masked_fill(~seen.unsqueeze(-1), 0.0), res[1].to(acc).masked_fill(~seen, -math.inf)
    return _math(q, k, v, vis, rule.scale, rule.softcap, extra)


def _attend_rows(acc, q, q_cols, keys: Keys, rule: Rule):
    """Keys whose columns differ per sequence: keys.cols (B, Tk), -1 marking an empty slot. In row tiles."""
    rows = _rows_per_tile(q, keys.cols.shape[1], None, rule)
    kc = keys.cols.to(q.device).unsqueeze(1)  # (B, 1, Tk)
    for r0 in range(0, q.shape[2], rows):
        qt = q[:, :, r0 : r0 + rows]
        vis = (kc >= 0) & within(q_cols[r0 : r0 + rows].to(q.device).view(-1, 1), kc, rule.window)  # (B, rows, Tk)
        if keys.valid is not None:
            vis &= keys.valid.unsqueeze(1)
        if bool(vis.any()):
            extra = rule.extra(qt, q_cols[r0 : r0 + rows], keys)
            acc.add(*_masked(qt, keys.k, keys.v, vis.unsqueeze(1), rule, extra), r0)


def attend(
    q,
    k,
    v,
    q_cols,
    k_cols,
    *,
    scale,
    key_valid=None,
    window=None,
    softcap=None,
    bias=None,
    select=None,
    into=None,
    kind=None,
):
    """Attention of q (B, H, Tq, D) to k, v (B, Hkv, Tk, D) with global columns q_cols, k_cols.

    key_valid: optional (B, Tk) bool, False for padding keys. k_cols is 1D when every sequence
    holds the same columns (the usual case), or (B, Tk) with -1 for empty slots after batched
    pass-Q decode. select: optional (B, Tq, T) bool over global key columns, True where a query keeps the
    key (indexed attention's top-k, attention/indexed.py), or (B, Hkv, Tq, T), one per KV head's group of query
    heads (a block indexer's): intersected with the visibility. bias: a score bias from
    global columns (`bias.ScoreBias`), evaluated tile by tile. Returns (out, lse)
    with out (B, H, Tq, D) and lse (B, H, Tq) in the accumulation dtype, or None if no key is visible. With `into` (a `merge.Accumulator` over q's
    rows) the partials are merged into it instead, only into the rows that see a key, and
    nothing is returned: how a ring accumulates its blocks without merging empty partials. kind: the block's
    `masks.classify`, where the caller has it already (`LayerStep.block_kind`: once per forward, not per layer).
    """
    acc = into if into is not None else Accumulator(q.shape[2])
    if q.shape[2] > 0 and k.shape[2] > 0:
        keys, rule = Keys(k, v, k_cols, key_valid), Rule(scale, window, softcap, bias)
        if select is not None:
            _attend_selected(acc, q, q_cols, keys, rule, select)
        else:
            _attend(acc, q, q_cols, keys, rule, kind)
    return acc.result() if into is None else None


def _attend_selected(acc, q, q_cols, keys: Keys, rule: Rule, select):
    """Indexed attention: each row sees only the keys its indexer kept, so no block is trivially masked; in
    row tiles, each under its explicit (rows, keys) mask: visibility, padding and the selection's columns."""
    if keys.cols.dim() != 1:
        raise ValueError("indexed attention takes one column order for every sequence (no batched pass-Q decode)")
    heads = select.shape[1] if select.dim() == 4 else None  # a selection per KV head (a block indexer's), or one
    if heads is not None and heads not in (1, keys.k.shape[1]):
        raise ValueError(f"a selection for {heads} heads over {keys.k.shape[1]} KV heads: one per KV head, or one")
    rows = _rows_per_tile(q, keys.cols.numel(), None, rule)
    cols = keys.cols.to(select.device)
    for r0 in range(0, q.shape[2], rows):
        r1 = min(r0 + rows, q.shape[2])
        vis = visible(q_cols[r0:r1], keys.cols, rule.window, q.device)  # (1, rows, Tk)
        if keys.valid is not None:
            vis = vis & keys.valid[:, None, :]
        kept = select[..., r0:r1, :][..., cols].to(q.device)
        vis = vis[:, None] & (kept if heads is not None else kept[:, None])  # (B, heads or 1, rows, Tk)
        if bool(vis.any()):
            qt = q[:, :, r0:r1]
            vis = vis.repeat_interleave(q.shape[1] // vis.shape[1], dim=1) if vis.shape[1] > 1 else vis  # query heads
            acc.add(*_masked(qt, keys.k, keys.v, vis, rule, rule.extra(qt, q_cols[r0:r1], keys)), r0)


def _attend(acc, q, q_cols, keys: Keys, rule: Rule, kind=None):
    if keys.cols.dim() == 2:
        _attend_rows(acc, q, q_cols, keys, rule)
        return
    kind = kind or classify(q_cols, keys.cols, rule.window)
    if kind != "mask":
        _block(acc, 0, q, q_cols, keys, rule, kind=kind)
        return
    q_runs, k_runs = runs(q_cols), runs(keys.cols)
    if len(q_runs) > _MAX_RUNS or len(k_runs) > _MAX_RUNS or len(q_runs) * len(k_runs) == 1:
        _block(acc, 0, q, q_cols, keys, rule)
        return
    # Split into contiguous sub-blocks: with head-tail shards most are trivially masked.
    for qa, qb in q_runs:
        for ka, kb in k_runs:
            _block(acc, qa, q[:, :, qa:qb], q_cols[qa:qb], keys.part(ka, kb), rule)
