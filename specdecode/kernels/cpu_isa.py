"""Our kernels built once per instruction set: the quantized products (`quant_gemm.cpp`, wrapped
by `quant.py`), row attention and RMS norm (`row_ops.cpp`), all computing in the 16 float lanes of
`lanes.h`, and the probe of their peak multiply-add rate (`probe.cpp`, for benchmarks' bounds).

Each source is built for AVX-512, for AVX2 + FMA + F16C, and portably (plain loops the compiler
vectorizes for its target: SSE2 on x86, NEON on ARM); `SPECDECODE_CPU_ISA` forces one, else the
best this CPU runs is used (`build.best_isa`). The library is compiled on first use into the cache
directory and called through ctypes: this module and `cpu_gemm.py` are the only ones that do.
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor

from specdecode.kernels import build
from specdecode.kernels.reference import rms_norm as torch_rms_norm

_HERE = Path(__file__).parent
_SOURCES = (_HERE / "quant_gemm.cpp", _HERE / "row_ops.cpp", _HERE / "probe.cpp")
_BUILDS = {  # compiler flags of each instruction set's build
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "generic": (),
}
HEAD_DIMS = (16, 32, 64, 128)  # head sizes the row attention is built for


@functools.cache
def library(isa: str) -> ctypes.CDLL | None:
    """The `isa` build of the kernels, or None where it cannot be had (no compiler, or the CPU
    cannot run it)."""
    if not build.isa_runs_here(isa):
        return None
    lib = build.load(f"cpu-{isa}", _SOURCES, ("-std=c++20", "-ffp-contract=fast", *_BUILDS[isa]))
    if lib is None:
        return None
    p, i, f, n = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.specdecode_qpacked_bytes.argtypes = [n, i, i]
    lib.specdecode_qpacked_bytes.restype = i
    lib.specdecode_qpack.argtypes = [n, p, i, i, p]
    lib.specdecode_qpack.restype = n
    lib.specdecode_qmm.argtypes = [n, p, i, i, p, i, p, i, n, n]
    lib.specdecode_qmm.restype = n
    lib.specdecode_qrows.argtypes = [n, p, i, p, i, p]
    lib.specdecode_qrows.restype = n
    # q, k, v (pointer, head stride, row stride); caches, head stride; rows, slots, count; CSR;
    # out, row stride; H, H_kv, D; scale; cos, sin; threads
    lib.specdecode_attend_rows.argtypes = [p, i, i] * 3 + [p, p, i, p, p, i, p, p, p, i, i, i, i, f, p, p, n]
    lib.specdecode_attend_rows.restype = n
    lib.specdecode_rms_norm.argtypes = [p, p, p, i, i, f]
    lib.specdecode_rms_norm.restype = None
    lib.specdecode_peak_flops.argtypes = [n, i]
    lib.specdecode_peak_flops.restype = ctypes.c_double
    lib.specdecode_read_bandwidth.argtypes = [n, i]
    lib.specdecode_read_bandwidth.restype = ctypes.c_double
    return lib


class Probe:
    """The `Probe` of one instruction set's build (`probe.cpp`): best of three runs each."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib

    def peak_flops(self, threads: int) -> float:
        return max(self._lib.specdecode_peak_flops(threads, 2_000_000) for _ in range(3))

    def read_bandwidth(self, threads: int) -> float:
        return float(self._lib.specdecode_read_bandwidth(threads, 512 * 2**20))


def probe(isa: str) -> Probe | None:
    lib = library(isa)
    return None if lib is None else Probe(lib)


class RowOps:
    """Row attention (the `AttendRows` interface) and RMS norm of one instruction set's build."""

    head_dims: ClassVar[tuple[int, ...]] = HEAD_DIMS

    def __init__(self, isa: str, lib: ctypes.CDLL) -> None:
        self.isa, self._lib = isa, lib

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """x (..., C) -> RMS-normalised and scaled by `weight` (C,): one call instead of torch's
        six ops (~40 us) for float32 on CPU without gradients; torch's otherwise."""
        if (
            x.dtype is not torch.float32
            or not x.is_cpu
            or weight.dtype is not torch.float32
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        ):
            return torch_rms_norm(x, weight, eps)
        x = x.contiguous()
        y = torch.empty_like(x)
        c = x.shape[-1]
        self._lib.specdecode_rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // c, c, eps)
        return y

    def __call__(  # shapes: `base.AttendRows`; q, k, v may have any strides with a unit last one
        self, q: Tensor, k: Tensor, v: Tensor, cache_k: Tensor, cache_v: Tensor, rows: Tensor,
        new_slots: Tensor, row_ptr: Tensor, idx: Tensor, out: Tensor, cos: Tensor | None = None,
        sin: Tensor | None = None,
    ) -> None:  # fmt: skip
        """Store the rows' new keys/values in the cache, then softmax(q k^T / sqrt(D)) v over each
        row's slots into `out`. With `cos`/`sin`, q and the new keys are rotated first (bitwise as
        `attention.apply_rotary` does). D must be one of HEAD_DIMS."""
        h, _, d = q.shape
        hkv = k.shape[0]
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        assert cache_k.stride() == cache_v.stride() and cache_k.stride(1) == d
        done = self._lib.specdecode_attend_rows(
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


def row_ops(isa: str) -> RowOps | None:
    lib = library(isa)
    return None if lib is None else RowOps(isa, lib)
