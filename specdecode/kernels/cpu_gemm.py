"""A matmul for the few rows of decoding and verification on CPU, weights in 32-column tiles.

Why: speculative decoding verifies a handful of tokens per forward and is worth it only when
that forward costs about as much as a one-token one. In float32 on CPU a one-token forward is
bound by reading the weights (~15 GB/s), but MKL's `x @ W` for 4-16 rows costs 1.7-2.8x one row
(measured on SmolLM2-135M's shapes), so most of what a draft saves is lost. `cpu_gemm.cpp` reads
each weight once for up to 12 rows, so a forward over 8 new tokens costs about what one does.
It also makes a row's result independent of the other rows of the batch (see the .cpp).

The kernel is compiled on first use with the machine's C++ compiler into the cache directory
(about a second) and called through ctypes: this module is the only one that does. Where it
cannot be had (no AVX-512, no compiler), `tiled_matmul` falls back to a batched matmul over the
tiles, which is as fast as `x @ W` for large M and gives the same values up to rounding. The
layers reach these functions only through the kernel interface (`kernels/cpu.py`).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from specdecode.kernels import build

TILE = 32
# Rows up to which our kernels beat PyTorch's matmul (measured on SmolLM2's shapes): float32 runs
# every block of 12 rows over a tile while it is in L2; bfloat16 makes a pass per 12 rows.
MAX_KERNEL_ROWS = 64
MAX_KERNEL_ROWS_BF16 = 24
BF16_CALL_ROWS = 64 * 12  # the most rows one call of the bf16 kernel takes
_SOURCE = Path(__file__).with_name("cpu_gemm.cpp")


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot run here (no AVX-512, no compiler, or an
    instruction set below AVX-512 forced by SPECDECODE_CPU_ISA)."""
    if not build.is_x86() or "avx512f" not in build.cpu_flags() or build.forced_isa() not in (None, "avx512"):
        return None
    lib = build.load("cpu_gemm-native", (_SOURCE,), ("-march=native",))
    if lib is None:
        return None
    for fn in (lib.specdecode_tiled_mm, lib.specdecode_tiled_mm_bf16):
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        fn.restype = ctypes.c_int
    return lib


@functools.cache
def kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The float32 few-row matmul `specdecode_tiled_mm`, or None where it cannot run here."""
    lib = _library()
    return None if lib is None else lib.specdecode_tiled_mm


@functools.cache
def kernel_bf16() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The bfloat16 one (`specdecode_tiled_mm_bf16`), where the CPU has AVX512_BF16."""
    lib = _library()
    return None if lib is None or "avx512_bf16" not in build.cpu_flags() else lib.specdecode_tiled_mm_bf16


def tile_weight(weight_t: torch.Tensor) -> torch.Tensor:
    """(K, N) -> (N / 32, K, 32): each 32-column tile made one contiguous block."""
    k, n = weight_t.shape
    return weight_t.reshape(k, n // TILE, TILE).permute(1, 0, 2).contiguous()


def untile_weight(tiled: torch.Tensor) -> torch.Tensor:
    """(N / 32, K, 32) -> (K, N), the inverse of `tile_weight`."""
    t, k, w = tiled.shape
    return tiled.permute(1, 0, 2).reshape(k, t * w)


def tiled_matmul(x: torch.Tensor, tiled: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ W for W tiled as (N / 32, K, 32); returns (M, N)."""
    m = x.shape[0]
    t, k, w = tiled.shape
    # Cheap checks first: this runs ~120 times per decoded token.
    fn = kernel() if 0 < m <= MAX_KERNEL_ROWS and x.dtype is torch.float32 and x.is_cpu else None
    if (
        fn is None
        or tiled.dtype is not torch.float32
        or (torch.is_grad_enabled() and (tiled.requires_grad or x.requires_grad))
    ):
        return torch.matmul(x, tiled).permute(1, 0, 2).reshape(m, t * w)  # (T, M, 32) -> (M, N)
    if not x.is_contiguous():
        x = x.contiguous()
    y = torch.empty(m, t * w)
    fn(x.data_ptr(), tiled.data_ptr(), y.data_ptr(), m, k, t * w, torch.get_num_threads())
    return y


def tile_weight_bf16(weight_t: torch.Tensor) -> torch.Tensor:
    """(K, N) -> bfloat16 (N / 32, K / 2, 32, 2): per tile, each pair of k's weights side by side
    for each of its 32 columns (the operand layout of the bf16 kernel)."""
    k, n = weight_t.shape
    w = weight_t.detach().bfloat16().reshape(k // 2, 2, n // TILE, TILE)  # (K/2, 2, T, 32)
    return w.permute(2, 0, 3, 1).contiguous()


def untile_weight_bf16(tiled: torch.Tensor) -> torch.Tensor:
    """(N / 32, K / 2, 32, 2) -> (K, N) bfloat16, the inverse of `tile_weight_bf16`."""
    t, k2, w, _ = tiled.shape
    return tiled.permute(1, 3, 0, 2).reshape(2 * k2, t * w)


def tiled_matmul_bf16(x: torch.Tensor, tiled: torch.Tensor) -> torch.Tensor:
    """Approximately x (M, K) @ W for W tiled by `tile_weight_bf16`: x rounded to bfloat16,
    products summed in float32. Returns (M, N) float32. Needs `kernel_bf16()`."""
    fn = kernel_bf16()
    if fn is None:
        raise RuntimeError("the bfloat16 CPU kernel is not available here")
    t, k2, w, _ = tiled.shape
    xb = x.to(torch.bfloat16).contiguous()
    y = torch.empty(x.shape[0], t * w)
    threads = torch.get_num_threads()
    for s in range(0, x.shape[0], BF16_CALL_ROWS):
        part, out = xb[s : s + BF16_CALL_ROWS], y[s : s + BF16_CALL_ROWS]
        fn(part.data_ptr(), tiled.data_ptr(), out.data_ptr(), part.shape[0], 2 * k2, t * w, threads)
    return y
