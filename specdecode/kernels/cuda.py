"""The kernels of a model on an NVIDIA GPU: cuBLAS products over rows in fixed blocks, Triton
kernels for the rest of a layer (RMS norm, SiLU * up, rotary and row attention over listed cache
slots), and a probe of what the card reaches (the bounds the benchmarks draw).

A row must come out of a forward with the same bits whatever else the forward holds, or a
verification step (several rows) and plain decoding (one) break a near-tie differently; in
bfloat16 exact ties are common. cuBLAS picks its kernel by shape, so every product is computed
in blocks of `ROW_MULTIPLE` rows (`PaddedLinear`; the LM head too). The Triton kernels
(`cuda_triton`) give each row its own program, the row attention each (row, key/value head),
walking the row's slots in order in blocks counted from its first: a row's result depends on its
own inputs alone, as the CPU kernels' do. They also replace PyTorch's many small ops: a SmolLM2
decoding step launched ~1,370 kernels before them and ~390 with them (H200). Launch overhead,
what bounds a small model there, is the engine's to remove: it replays decoding steps from
captured CUDA graphs (`engine.graphs`).
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

from specdecode.kernels.reference import EXACT, TorchLinear
from specdecode.kernels.reference import rms_norm as reference_rms_norm
from specdecode.kernels.reference import silu_mul as reference_silu_mul

ROW_MULTIPLE = 64
SILU_BLOCK = 1024  # columns of a row per SiLU program


class PaddedLinear(TorchLinear):
    """x @ W for W kept (in, out), computed in blocks of ROW_MULTIPLE rows, the last padded: every
    product cuBLAS runs has the same shape, a verification step of several requests' trees (more
    than ROW_MULTIPLE rows) too, so a row's bits are the same in any step."""

    name: ClassVar[str] = "torch-padded"

    def matmul(self, x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
        m = x.shape[0]
        pad = -m % ROW_MULTIPLE
        padded = F.pad(x, (0, 0, 0, pad)) if pad else x
        products = [TorchLinear.matmul(self, b, packed, bias) for b in padded.split(ROW_MULTIPLE)]
        return (products[0] if len(products) == 1 else torch.cat(products))[:m]


@functools.cache
def _triton() -> Any:
    """The module of the Triton kernels (`cuda_triton`), imported when first needed: each kernel
    compiles when first launched."""
    from specdecode.kernels import cuda_triton

    return cuda_triton


class TritonRows:
    """`AttendRows` on the GPU in two launches: the rows' keys (rotated) and values into their
    slots, then each row's attention over its slots, its queries rotated as they load."""

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
        assert q.stride(2) == k.stride(2) == v.stride(2) == out.stride(2) == 1
        cos, sin = cos.contiguous(), sin.contiguous()
        kernels = _triton()
        kernels.store_rows[(r, h_kv)](
            k, v, cache_k, cache_v, rows, new_slots, cos, sin,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cache_k.stride(0), cache_k.stride(1), cache_v.stride(0), cache_v.stride(1), cos.stride(0),
            D=d,
        )  # fmt: skip
        group = h // h_kv
        kernels.row_attention[(r, h_kv)](
            q, cache_k, cache_v, out, rows, row_ptr, idx, cos, sin, 1.0 / math.sqrt(d),
            q.stride(0), q.stride(1), cache_k.stride(0), cache_k.stride(1), cache_v.stride(0),
            cache_v.stride(1), out.stride(0), out.stride(1), cos.stride(0),
            GROUP=group, GP=triton_pow2(group), D=d, BLOCK=32 if d <= 64 else 16,
        )  # fmt: skip


def _needs_torch(x: Tensor, *more: Tensor) -> bool:
    """Whether PyTorch's op must run instead of a Triton kernel: not on a GPU, a dtype the kernels
    were not written for, or gradients wanted (the kernels have no backward)."""
    return (
        not x.is_cuda
        or x.dtype not in TritonRows.dtypes
        or (torch.is_grad_enabled() and any(t.requires_grad for t in (x, *more)))
    )


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`reference.rms_norm` as one launch, each row by one program (its bits its own)."""
    if _needs_torch(x, weight):
        return reference_rms_norm(x, weight, eps)
    return launch_rms_norm(x, weight, eps)


def silu_mul(gate_up: Tensor) -> Tensor:
    """`reference.silu_mul` as one launch."""
    if _needs_torch(gate_up):
        return reference_silu_mul(gate_up)
    return launch_silu_mul(gate_up)


def launch_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The Triton RMS norm on x (..., C), wherever its tensors are (the interpreter's on a CPU)."""
    n = x.shape[-1]
    rows = _rows(x)  # (M, C)
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _triton().rms_norm_rows[(rows.shape[0],)](
        rows, weight, out, rows.stride(0), out.stride(0), n, eps,
        LOW=x.dtype != torch.float32, BLOCK=triton_pow2(n),
    )  # fmt: skip
    return out.view(*x.shape[:-1], n)


def launch_silu_mul(gate_up: Tensor) -> Tensor:
    """The Triton SiLU(gate) * up on gate_up (..., 2 I), wherever its tensors are."""
    n = gate_up.shape[-1] // 2
    rows = _rows(gate_up)  # (M, 2 I)
    out = torch.empty(rows.shape[0], n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(SILU_BLOCK, triton_pow2(n))
    grid = (rows.shape[0], -(-n // block))
    _triton().silu_mul_rows[grid](rows, out, rows.stride(0), out.stride(0), n, BLOCK=block)
    return out.view(*gate_up.shape[:-1], n)


def _rows(x: Tensor) -> Tensor:
    """x (..., C) as (M, C) with unit column stride."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def triton_pow2(n: int) -> int:
    """The least power of two >= n (Triton's block sizes)."""
    return 1 << (n - 1).bit_length()


def _works(rows: TritonRows) -> bool:
    """Whether Triton is there and its kernels run here: one launch of each on a few values."""
    try:
        dev = torch.device("cuda")
        q, k = torch.randn(2, 1, 64, device=dev), torch.randn(1, 1, 64, device=dev)
        cache = torch.zeros(1, 4, 64, device=dev)
        one = torch.zeros(1, dtype=torch.long, device=dev)
        out = torch.empty(1, 2, 64, device=dev)
        ptr = torch.tensor([0, 1], device=dev)
        cos, sin = torch.ones(1, 64, device=dev), torch.zeros(1, 64, device=dev)
        rows(q, k, k, cache, cache.clone(), one, one, ptr, one, out, cos, sin)
        done = (out, rms_norm(q[:, 0], torch.ones(64, device=dev), 1e-6), silu_mul(q[:, 0]))
        torch.cuda.synchronize()
        return all(bool(torch.isfinite(t).all()) for t in done)
    except Exception as exc:  # no Triton, or it cannot build for this card
        warnings.warn(f"no Triton kernels on this GPU ({exc}): PyTorch's ops and SDPA instead", stacklevel=2)
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

    def peak_int8_ops(self, threads: int) -> float | None:
        """None: int8 activations are the CPU kernels' (a GPU runs bfloat16)."""
        return None


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
    """The GPU's kernel set (checked once per process: the Triton kernels where they run)."""
    probe = CudaProbe()
    torch_ops = dataclasses.replace(EXACT, name="torch-cuda", linears=(PADDED,), head=PADDED, probe=probe)
    rows = TritonRows()
    if not _works(rows):
        return torch_ops
    return dataclasses.replace(
        torch_ops, name="torch-cuda-triton", rms_norm=rms_norm, silu_mul=silu_mul, attend_rows=rows
    )
