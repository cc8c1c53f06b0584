"""The kernels of a model on an NVIDIA GPU: PyTorch's ops (cuBLAS products) with rows padded to a
fixed multiple, a Triton row attention over listed cache slots, and a probe of what the card
reaches (the bounds the benchmarks draw).

A row must come out of a forward with the same bits whatever else the forward holds, or a
verification step (several rows) and plain decoding (one) break a near-tie differently; in
bfloat16 exact ties are common. cuBLAS picks its kernel by shape, so every product of fewer than
`ROW_MULTIPLE` rows is computed as one of `ROW_MULTIPLE` (`PaddedLinear`; the LM head too). The
row attention (`TritonRows`) gives each (row, key/value head) its own program, which walks the
row's slots in order in blocks counted from its first slot: its result depends on the row's own
slots alone, as the CPU kernel's does. Launch overhead, what bounds a small model there, is the
engine's to remove: it replays decoding steps from captured CUDA graphs (`engine.graphs`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from specdecode.kernels.reference import EXACT, TorchLinear, apply_rotary

ROW_MULTIPLE = 64


class PaddedLinear(TorchLinear):
    """x @ W for W kept (in, out), computed over rows padded to a multiple of ROW_MULTIPLE."""

    name: ClassVar[str] = "torch-padded"

    def matmul(self, x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
        m = x.shape[0]
        pad = -m % ROW_MULTIPLE
        if not pad:
            return super().matmul(x, packed, bias)
        return super().matmul(F.pad(x, (0, 0, 0, pad)), packed, bias)[:m]


@functools.cache
def _row_attention() -> Any:
    """The Triton kernel, compiled when first launched (under TRITON_INTERPRET=1, interpreted on
    the CPU: how the tests check it without a GPU)."""
    import triton
    import triton.language as tl

    @triton.jit
    def row_attention(
        q, kc, vc, out, row_ptr, idx, scale,
        q_sh, q_sr, k_sh, k_ss, v_sh, v_ss, o_sr, o_sh,
        GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # One program: row r's query heads of key/value head kvh, over the row's slots
        # idx[row_ptr[r] : row_ptr[r+1]] in blocks of BLOCK (online softmax, float32).
        r = tl.program_id(0)
        kvh = tl.program_id(1)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        live = g < GROUP
        heads = kvh * GROUP + g
        qv = tl.load(q + heads[:, None] * q_sh + r * q_sr + d[None, :], mask=live[:, None], other=0.0)
        qv = qv.to(tl.float32)
        lo = tl.load(row_ptr + r).to(tl.int32)
        hi = tl.load(row_ptr + r + 1).to(tl.int32)
        top = tl.full([GP], float("-inf"), tl.float32)
        total = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for s in range(lo, hi, BLOCK):
            at = s + tl.arange(0, BLOCK)
            seen = at < hi
            slot = tl.load(idx + at, mask=seen, other=0)
            kk = tl.load(kc + kvh * k_sh + slot[:, None] * k_ss + d[None, :], mask=seen[:, None], other=0.0)
            score = tl.sum(qv[:, None, :] * kk.to(tl.float32)[None, :, :], axis=2) * scale  # (GP, BLOCK)
            score = tl.where(seen[None, :], score, float("-inf"))
            new_top = tl.maximum(top, tl.max(score, axis=1))
            fade = tl.exp(top - new_top)
            p = tl.exp(score - new_top[:, None])
            vv = tl.load(vc + kvh * v_sh + slot[:, None] * v_ss + d[None, :], mask=seen[:, None], other=0.0)
            total = total * fade + tl.sum(p, axis=1)
            acc = acc * fade[:, None] + tl.sum(p[:, :, None] * vv.to(tl.float32)[None, :, :], axis=1)
            top = new_top
        res = (acc / total[:, None]).to(out.dtype.element_ty)
        tl.store(out + r * o_sr + heads[:, None] * o_sh + d[None, :], res, mask=live[:, None])

    return row_attention


class TritonRows:
    """`AttendRows` on the GPU: rotary applied to the rows' queries and keys, their keys and
    values stored at their slots, then the Triton kernel over each row's slots."""

    head_dims: ClassVar[tuple[int, ...]] = (8, 16, 32, 64, 128)
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16, torch.float16)
    device_type: ClassVar[str] = "cuda"

    def __call__(
        self,
        q: Tensor,  # (H, T, D)
        k: Tensor,  # (H_kv, T, D)
        v: Tensor,  # (H_kv, T, D)
        cache_k: Tensor,  # (H_kv, S, D)
        cache_v: Tensor,  # (H_kv, S, D)
        rows: Tensor,  # (R,) long
        new_slots: Tensor,  # (R,) long
        row_ptr: Tensor,  # (R+1,) long
        idx: Tensor,  # (nnz,) long
        out: Tensor,  # (T, H, D)
        cos: Tensor,  # (T, D)
        sin: Tensor,  # (T, D)
    ) -> None:
        h, _, d = q.shape
        h_kv, r = k.shape[0], rows.shape[0]
        if r == 0:
            return
        c, s = cos[rows], sin[rows]  # (R, D)
        qr = apply_rotary(q[:, rows], c, s).contiguous()  # (H, R, D)
        cache_k[:, new_slots] = apply_rotary(k[:, rows], c, s)
        cache_v[:, new_slots] = v[:, rows]
        res = torch.empty(r, h, d, dtype=out.dtype, device=out.device)  # (R, H, D)
        group = h // h_kv
        _row_attention()[(r, h_kv)](
            qr, cache_k, cache_v, res, row_ptr, idx, 1.0 / math.sqrt(d),
            qr.stride(0), qr.stride(1), cache_k.stride(0), cache_k.stride(1), cache_v.stride(0),
            cache_v.stride(1), res.stride(0), res.stride(1),
            GROUP=group, GP=triton_pow2(group), D=d, BLOCK=32 if d <= 64 else 16,
        )  # fmt: skip
        out[rows] = res


def triton_pow2(n: int) -> int:
    """The least power of two >= n (Triton's block sizes)."""
    return 1 << (n - 1).bit_length()


def _works(rows: TritonRows) -> bool:
    """Whether Triton is there and its kernel runs here: one launch on a few slots."""
    try:
        dev = torch.device("cuda")
        q, k = torch.randn(2, 1, 64, device=dev), torch.randn(1, 1, 64, device=dev)
        cache = torch.zeros(1, 4, 64, device=dev)
        one = torch.zeros(1, dtype=torch.long, device=dev)
        out = torch.empty(1, 2, 64, device=dev)
        ptr = torch.tensor([0, 1], device=dev)
        cos, sin = torch.ones(1, 64, device=dev), torch.zeros(1, 64, device=dev)
        rows(q, k, k, cache, cache.clone(), one, one, ptr, one, out, cos, sin)
        torch.cuda.synchronize()
        return bool(torch.isfinite(out).all())
    except Exception as exc:  # no Triton, or it cannot build for this card
        warnings.warn(f"no Triton row attention on this GPU ({exc}); SDPA attends instead", stacklevel=2)
        return False


class CudaProbe:
    """Copy bandwidth and bfloat16 matrix-product rate of the current GPU, measured once each."""

    def read_bandwidth(self, threads: int) -> float:
        """Bytes/s of a device-to-device copy of 1 GiB, counting bytes read and written (a
        weight-bound forward reads as fast as a copy moves both)."""
        return _copy_rate()

    def peak_flops(self, threads: int) -> float:
        """FLOP/s of a 8192^3 bfloat16 product on random data."""
        return _matmul_rate()


def _timed(fn: Callable[[], object], repeats: int = 10) -> float:
    """Median seconds of `fn()` on the GPU, by CUDA events, after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return sorted(times)[len(times) // 2]


@functools.cache
def _copy_rate() -> float:
    src = torch.randn(1 << 28, device="cuda")  # 1 GiB of float32
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / _timed(lambda: dst.copy_(src))


@functools.cache
def _matmul_rate() -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / _timed(lambda: a @ b)


PADDED = PaddedLinear()


@functools.cache
def cuda_kernels() -> Any:
    """The GPU's kernel set (checked once per process: the Triton attention where it runs)."""
    rows = TritonRows()
    return dataclasses.replace(
        EXACT,
        name="torch-cuda",
        linears=(PADDED,),
        head=PADDED,
        attend_rows=rows if _works(rows) else None,
        probe=CudaProbe(),
    )
