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
import math
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
    lib_path = build.shared_library(_SOURCE, ("-march=native",), "native")
    if lib_path is None:
        return None
    try:  # torch is imported already, so the kernels' libgomp.so.1 is torch's: one thread pool
        lib = ctypes.CDLL(str(lib_path))
    except OSError:
        return None
    for fn in (lib.specdecode_tiled_mm, lib.specdecode_tiled_mm_bf16):
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        fn.restype = ctypes.c_int
    p, i = ctypes.c_void_p, ctypes.c_int64
    # q, k, v (pointer, head stride, row stride); caches, head stride; rows, slots, count; CSR;
    # out, row stride; H, H_kv, D; scale; cos, sin; threads
    lib.specdecode_attend_rows.argtypes = (
        [p, i, i] * 3 + [p, p, i] + [p, p, i] + [p, p] + [p, i] + [i, i, i] + [ctypes.c_float]
        + [p, p] + [ctypes.c_int]
    )  # fmt: skip
    lib.specdecode_attend_rows.restype = ctypes.c_int
    lib.specdecode_rms_norm.argtypes = [p, p, p, i, i, ctypes.c_float]
    lib.specdecode_rms_norm.restype = None
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


@functools.cache
def attention_kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """`specdecode_attend_rows`: attention of listed rows over listed cache slots (see the .cpp)."""
    lib = _library()
    return None if lib is None else lib.specdecode_attend_rows


ATTENTION_HEAD_DIMS = (16, 32, 64, 128)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x (..., C) float32 on CPU -> RMS-normalised and scaled by `weight` (C,), or None where the
    kernel cannot take it (no kernel, other dtype or device, gradients wanted)."""
    lib = _library()
    if (
        lib is None
        or x.dtype is not torch.float32
        or not x.is_cpu
        or weight.dtype is not torch.float32
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        return None
    x = x.contiguous()
    y = torch.empty_like(x)
    c = x.shape[-1]
    lib.specdecode_rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // c, c, eps)
    return y


def attend_rows(
    q: torch.Tensor,  # (H, T, D) float32, any strides with unit last stride
    k: torch.Tensor,  # (H_kv, T, D) the new keys, rotary applied
    v: torch.Tensor,  # (H_kv, T, D) the new values
    cache_k: torch.Tensor,  # (H_kv, S, D) the layer's key slots
    cache_v: torch.Tensor,  # (H_kv, S, D)
    rows: torch.Tensor,  # (R,) long: which of the T rows to compute
    new_slots: torch.Tensor,  # (R,) long: the slot each row's key/value is stored at
    row_ptr: torch.Tensor,  # (R+1,) long: row r sees slots idx[row_ptr[r]:row_ptr[r+1]]
    idx: torch.Tensor,  # (nnz,) long
    out: torch.Tensor,  # (T, H, D) float32 contiguous: rows `rows` are written
    cos: torch.Tensor | None = None,  # (T, D) contiguous: rotary tables at each row's position
    sin: torch.Tensor | None = None,  # (T, D)
) -> None:
    """Store the rows' new keys/values in the cache, then softmax(q k^T / sqrt(D)) v over each
    row's slots into `out`. With `cos`/`sin`, q and the new keys are rotated first (bitwise as
    `attention.apply_rotary` does). Needs `attention_kernel()` and D in ATTENTION_HEAD_DIMS."""
    fn = attention_kernel()
    h, _, d = q.shape
    hkv = k.shape[0]
    assert fn is not None and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    assert cache_k.stride() == cache_v.stride() and cache_k.stride(1) == d
    done = fn(
        q.data_ptr(), q.stride(0), q.stride(1),
        k.data_ptr(), k.stride(0), k.stride(1),
        v.data_ptr(), v.stride(0), v.stride(1),
        cache_k.data_ptr(), cache_v.data_ptr(), cache_k.stride(0),
        rows.data_ptr(), new_slots.data_ptr(), rows.shape[0], row_ptr.data_ptr(), idx.data_ptr(),
        out.data_ptr(), out.stride(0), h, hkv, d, 1.0 / math.sqrt(d),
        None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if done != 0:
        raise ValueError(f"attention kernel: unsupported shape (H={h}, H_kv={hkv}, D={d})")


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
