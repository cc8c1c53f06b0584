"""A matmul for the few rows of decoding and verification on CPU, weights in 32-column tiles.

Why: speculative decoding verifies a handful of tokens per forward and is worth it only when
that forward costs about as much as a one-token one. In float32 on CPU a one-token forward is
bound by reading the weights (~15 GB/s), but MKL's `x @ W` for 4-16 rows costs 1.7-2.8x one row
(measured on SmolLM2-135M's shapes), so most of what a draft saves is lost. `cpu_gemm.cpp` reads
each weight once for up to 12 rows, so a forward over 8 new tokens costs about what one does.
It also makes a row's result independent of the other rows of the batch (see the .cpp).

The kernel is compiled on first use with the machine's C++ compiler into the cache directory
(about a second) and called through ctypes. Where it cannot be had (no AVX-512, no compiler,
`SPECDECODE_CPU_KERNELS=0`), `tiled_matmul` falls back to a batched matmul over the tiles,
which is as fast as `x @ W` for large M and gives the same values up to rounding.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch

from specdecode.models.cache import atomic_file, cache_root

TILE = 32
MAX_KERNEL_ROWS = 24  # above this, MKL's batched matmul over the tiles is as fast (it blocks over M)
_SOURCE = Path(__file__).with_name("cpu_gemm.cpp")
ENV_SWITCH = "SPECDECODE_CPU_KERNELS"


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return line.split(":", 1)[-1].strip()


def _compile(compiler: str, source: Path, out: Path) -> None:
    with atomic_file(out) as tmp:
        cmd = [compiler, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(source), "-o", str(tmp)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr else "compiler failed")


@functools.cache
def kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The compiled `specdecode_tiled_mm`, or None where it cannot run here."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    flags = _cpu_flags()
    if platform.machine().lower() not in ("x86_64", "amd64") or "avx512f" not in flags.split():
        return None
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        return None
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + flags.encode() + compiler.encode()).hexdigest()[:16]
    lib_path = cache_root() / "kernels" / f"cpu_gemm-{key}.so"
    try:
        if not lib_path.is_file():
            lib_path.parent.mkdir(parents=True, exist_ok=True)
            _compile(compiler, _SOURCE, lib_path)
        fn = ctypes.CDLL(str(lib_path)).specdecode_tiled_mm
    except (OSError, RuntimeError):
        return None
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn  # torch is imported already, so the kernel's libgomp.so.1 is torch's: one thread pool


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
