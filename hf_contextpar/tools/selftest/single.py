"""`selftest --simulated`: every attention algorithm, kernel and merge on one process (one GPU hosts
only one NCCL rank), against plain attention written out in `spec.reference`.

Three groups of checks, each recorded as passed or failed with the first difference found:
- backends: the fused kernels that return the LSE, called directly (CPU: PyTorch's CPU flash
  kernel; CUDA: the flash kernel in fp16/bf16 and the memory-efficient one, with and without a
  bias, in every dtype), and on CUDA whether `kernels` accepted them (otherwise it falls back to
  the slow math path);
- kernels + merge: `kernels.attend` of a head-tail query shard against the keys split into parts
  (whole, contiguous, head-tail, scattered, and per-sequence tables with empty slots), under each
  mask (causal, padding, sliding window, soft-capping, all three), the parts merged both ways the
  algorithms merge (the ring's running `Accumulator` and `merge_packed` of stacked partials);
- algorithms: every case of `spec.CASES` on N = 2, 3, 4 simulated ranks at an uneven length, under
  the causal and the combined mask: every rank's (out, LSE), its traffic, and ranks that compute
  the same rows agreeing bit for bit.
"""

from __future__ import annotations

import math
import time
import zlib

import torch

from ...attention import kernels
from ...attention.merge import Accumulator, merge_packed, pack_partial
from ...cache.blocks import unpack_kv
from . import spec
from .simulated import pack_kv

MASKS = {  # name -> (padding, window, softcap)
    "causal": (False, None, None),
    "pad": (True, None, None),
    "window": (False, 0.3, None),
    "softcap": (False, None, spec.SOFTCAP),
    "all": (True, 0.3, spec.SOFTCAP),
}
PARTS = ("whole", "contiguous", "head_tail", "scattered", "per_sequence")
ALGORITHM_MASKS = ("causal", "all")


def _check(records: list, name: str, fn):
    """Run one check; record it as passed, or failed with its message (first lines)."""
    t0 = time.perf_counter()
    try:
        fn()
        status, detail = "pass", ""
    except Exception as e:  # noqa: BLE001 - a failed check is a result, not the end of the run
        status = "fail"
        detail = f"{type(e).__name__}: " + "\n".join(str(e).strip().splitlines()[:6])
    records.append(dict(name=name, status=status, detail=detail, seconds=round(time.perf_counter() - t0, 3)))


def _close(got, want, tol, what):
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol, msg=lambda m: f"{what}\n{m}")


# -- backends -----------------------------------------------------------------------------------
def _backend_checks(records, device, dname, dtype, tol):
    gen = torch.Generator().manual_seed(1)
    b, h, s, d = 2, 4, 96 if device.type == "cpu" else 512, 64
    q, k, v = (torch.randn(b, h, s, d, generator=gen, dtype=torch.float64).to(device, dtype) for _ in range(3))
    scale = 1 / math.sqrt(d)
    causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()
    valid = torch.rand(b, s, generator=gen).to(device) > 0.3
    valid[:, 0] = True
    bias = torch.zeros(b, 1, s, s, dtype=dtype, device=device).masked_fill(~valid[:, None, None, :], -math.inf)

    def against(out, lse, vis):
        want_out, want_lse = _masked_reference(q, k, v, vis, scale)
        _close(out, want_out, tol, "out differs")
        _close(lse[..., :s], want_lse, tol, "LSE differs")

    if device.type == "cpu":
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        for causal_ in (False, True):
            _check(
                records,
                f"backend/cpu_flash{'_causal' if causal_ else ''}/{dname}",
                lambda c=causal_: against(*flash(q, k, v, 0.0, c, scale=scale)[:2], causal if c else None),
            )
        _check(
            records,
            f"backend/cpu_flash_bias/{dname}",
            lambda: against(*flash(q, k, v, 0.0, False, attn_mask=bias, scale=scale)[:2], valid[:, None, None, :]),
        )
        return
    if dtype in (torch.float16, torch.bfloat16):
        flash = torch.ops.aten._scaled_dot_product_flash_attention
        for causal_ in (False, True):
            _check(
                records,
                f"backend/flash{'_causal' if causal_ else ''}/{dname}",
                lambda c=causal_: against(*flash(q, k, v, 0.0, c, False, scale=scale)[:2], causal if c else None),
            )
        if torch.cuda.get_device_capability(device) >= (8, 0):  # cuDNN's fused attention: Ampere and later
            cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention
            _check(
                records,
                f"backend/cudnn_causal/{dname}",
                lambda: against(*_cudnn_lse(cudnn(q, k, v, None, True, 0.0, True, False, scale=scale), s), causal),
            )
    efficient = torch.ops.aten._scaled_dot_product_efficient_attention
    _check(
        records,
        f"backend/efficient_causal/{dname}",
        lambda: against(*efficient(q, k, v, None, True, 0.0, True, scale=scale)[:2], causal),
    )
    _check(
        records,
        f"backend/efficient_bias/{dname}",
        lambda: against(
            *efficient(q, k, v, bias.expand(b, h, s, s), True, 0.0, False, scale=scale)[:2], valid[:, None, None, :]
        ),
    )

    def accepted():
        if not kernels.cuda_kernel_ok(dtype, device):
            raise AssertionError(f"kernels rejected the fused CUDA kernels for {dtype}: every block runs the math path")

    _check(records, f"backend/kernels_use_fused/{dname}", accepted)


def _cudnn_lse(res, s):
    return res[0], res[1].reshape(*res[1].shape[:3])[..., :s]  # its LSE is (B, H, Tq, 1)


def _masked_reference(q, k, v, vis, scale):
    """Plain attention in fp64 under a visibility mask broadcastable to (B, H, Tq, Tk) (None: all)."""
    s = q.double() @ k.double().transpose(-1, -2) * scale
    if vis is not None:
        s = s.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    return torch.softmax(s, dim=-1) @ v.double(), lse


# -- kernels + merge ----------------------------------------------------------------------------
def _key_parts(kind: str, s: int, batch: int, gen) -> list[torch.Tensor]:
    """The key columns of each part: 1D, or (B, slots) with -1 for empty slots ("per_sequence")."""
    if kind == "whole":
        return [torch.arange(s)]
    if kind == "contiguous":  # uneven, as KV-Runahead's partitions
        cut = [0, s // 5, s // 5 + s // 2, s]
        return [torch.arange(a, b) for a, b in zip(cut, cut[1:])]
    if kind == "head_tail":  # 3 ranks: rank i holds chunks i and 5 - i
        chunks = torch.arange(s).tensor_split(6)
        return [torch.cat([chunks[i], chunks[5 - i]]) for i in range(3)]
    if kind == "scattered":
        owner = torch.randint(0, 3, (s,), generator=gen)
        return [(owner == i).nonzero().flatten() for i in range(3)]
    # per_sequence: every sequence splits its keys differently; parts padded to one width with -1
    parts = [[] for _ in range(3)]
    for _ in range(batch):
        owner = torch.randint(0, 3, (s,), generator=gen)
        for i in range(3):
            parts[i].append((owner == i).nonzero().flatten())
    out = []
    for rows in parts:
        width = max(r.numel() for r in rows)
        table = torch.full((batch, width), -1, dtype=torch.long)
        for b, r in enumerate(rows):
            table[b, : r.numel()] = r
        out.append(table)
    return out


def _kernel_merge_check(device, dtype, tol, mask: str, parts: str):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{mask}/{parts}".encode()))
    batch, heads, kv_heads, s = 3, 8, 2, 97
    with_pad, window_frac, softcap = MASKS[mask]
    window = max(1, int(s * window_frac)) if window_frac else None
    valid = spec.make_padding(batch, s, gen).to(device) if with_pad else None
    q, k, v = (
        (torch.randn(batch, h, s, spec.HEAD_DIM, generator=gen, dtype=torch.float64) * 1.5).to(device, dtype)
        for h in (heads, kv_heads, kv_heads)
    )
    want_out, want_lse = spec.reference(q, k, v, valid, spec.SCALE, window, softcap)
    chunks = torch.arange(s).tensor_split(6)
    q_cols = torch.cat([chunks[1], chunks[4]])  # rank 1's head-tail rows of 3
    qs = q.index_select(2, q_cols.to(device))
    acc, packed = Accumulator(), []
    for cols in _key_parts(parts, s, batch, gen):
        ks, vs = unpack_kv(pack_kv(cols, k, v, empty=1e3))  # as a rank's cache holds them
        key_valid = None
        if valid is not None:
            idx = cols.clamp(min=0).to(device)
            key_valid = valid.index_select(1, idx) if cols.dim() == 1 else torch.gather(valid, 1, idx)
        res = kernels.attend(
            qs, ks, vs, q_cols, cols, scale=spec.SCALE, key_valid=key_valid, window=window, softcap=softcap
        )
        if res is not None:
            acc.add(*res)
        packed.append(pack_partial(res, (*qs.shape[:3], spec.HEAD_DIM), kernels.acc_dtype(dtype), device))
    ring_out, ring_lse = acc.out, acc.lse
    stacked_out, stacked_lse = merge_packed(torch.stack(packed))
    want_out, want_lse = want_out.index_select(2, q_cols.to(device)), want_lse.index_select(2, q_cols.to(device))
    _close(ring_out, want_out, tol, "running merge (ring): out differs")
    _close(ring_lse, want_lse, tol, "running merge (ring): LSE differs")
    _close(stacked_out, want_out, tol, "stacked merge: out differs")
    _close(stacked_lse, want_lse, tol, "stacked merge: LSE differs")


# -- the run ------------------------------------------------------------------------------------
def run_checks(device: torch.device, dtypes: list[str], worlds=(2, 3, 4), log=print) -> list[dict]:
    """Every check on `device` in `dtypes` (names of spec.DTYPES[device.type]); one record per check."""
    table = spec.DTYPES[device.type]
    records = []
    for dname in dtypes:
        dtype, tol = table[dname]
        t0, before = time.perf_counter(), len(records)
        _backend_checks(records, device, dname, dtype, tol)
        for mask in MASKS:
            for parts in PARTS:
                _check(
                    records,
                    f"kernels+merge/{mask}/{parts}/{dname}",
                    lambda m=mask, p=parts: _kernel_merge_check(device, dtype, tol, m, p),
                )
        for case in spec.CASES:
            for n in worlds:
                length = spec.lengths(case, n)[-1]
                for mask in ALGORITHM_MASKS:
                    _check(
                        records,
                        f"algorithm/{case.name}/N{n}/T{length}/{mask}/{dname}",
                        lambda c=case, n=n, t=length, m=mask: spec.check_case(
                            c, n, t, "gqa", m, dtype, tol, device=device
                        ),
                    )
        mine = records[before:]
        bad = sum(r["status"] != "pass" for r in mine)
        used = f", fused kernels {kernels.cuda_kernels(dtype, device)}" if device.type == "cuda" else ""
        log(
            f"  {dname}: {len(mine) - bad}/{len(mine)} checks passed ({time.perf_counter() - t0:.1f} s{used})"
            + "".join(f"\n    FAIL {r['name']}: {r['detail'].splitlines()[0]}" for r in mine if r["status"] != "pass")
        )
    return records
