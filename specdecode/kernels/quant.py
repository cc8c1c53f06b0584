"""Products with weights kept in GGUF's block formats, on every CPU (`quant_gemm.cpp`).

The source is built once per instruction set (AVX-512, AVX2 + FMA, and a portable build that the
compiler vectorizes for whatever it targets: SSE2 on x86, NEON on ARM); `SPECDECODE_CPU_ISA`
forces one. Each forward decodes a weight block once for all the rows of x (in registers for a
few rows, into float32 scratch for many), so verifying a draft adds only its multiply-adds to
what decoding one token costs; a row's result does not depend on the other rows, and the AVX-512
and AVX2 builds give the same bits.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor

from specdecode.kernels import build
from specdecode.kernels.base import QUANT_FORMATS, QuantWeight

_SOURCE = Path(__file__).with_name("quant_gemm.cpp")
_BUILDS = {  # compiler flags and defines of each instruction set's build
    "avx512": (
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx2",
        "-mfma",
        "-mf16c",
    ),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "generic": (),
}


@functools.cache
def library(isa: str) -> ctypes.CDLL | None:
    """The `isa` build of the kernels, or None where it cannot be had (no compiler, or the CPU
    cannot run it)."""
    if not build.isa_runs_here(isa):
        return None
    path = build.shared_library(_SOURCE, ("-ffp-contract=fast", *_BUILDS[isa]), isa)
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:
        return None
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.specdecode_qmm.argtypes = [ctypes.c_int, p, i, i, p, i, p, i, ctypes.c_int]
    lib.specdecode_qmm.restype = ctypes.c_int
    lib.specdecode_qrows.argtypes = [ctypes.c_int, p, i, p, i, p]
    lib.specdecode_qrows.restype = ctypes.c_int
    return lib


class QuantCPU:
    """The quantized products of one instruction set's build (see the module doc)."""

    formats: ClassVar[frozenset[str]] = frozenset(QUANT_FORMATS)

    def __init__(self, isa: str, lib: ctypes.CDLL) -> None:
        self.isa, self._lib = isa, lib
        self.name = f"cpu-quant-{isa}"

    def matmul(self, x: Tensor, weight: QuantWeight, bias: Tensor | None = None) -> Tensor:
        x = x.detach().float().contiguous()  # (M, in)
        m, k = x.shape
        n = weight.out_features
        y = torch.empty(m, n)  # (M, out)
        if m:
            threads, offset = torch.get_num_threads(), 0
            for part in weight.parts:
                fmt = QUANT_FORMATS[part.format][0]
                out = y.data_ptr() + 4 * offset
                done = self._lib.specdecode_qmm(
                    fmt, x.data_ptr(), m, k, part.data.data_ptr(), part.rows, out, n, threads
                )
                if done != 0:
                    raise ValueError(f"{self.name}: cannot multiply {part.format} rows of {k} weights")
                offset += part.rows
        if bias is not None:
            y += bias
        return y

    def rows(self, weight: QuantWeight, ids: Tensor) -> Tensor:
        (part,) = weight.parts
        ids = ids.reshape(-1).to(torch.int64).contiguous()  # (n,)
        out = torch.empty(ids.numel(), weight.in_features)  # (n, in)
        fmt = QUANT_FORMATS[part.format][0]
        done = self._lib.specdecode_qrows(
            fmt, part.data.data_ptr(), weight.in_features, ids.data_ptr(), ids.numel(), out.data_ptr()
        )
        if done != 0:
            raise ValueError(f"{self.name}: cannot read {part.format} rows of {weight.in_features} weights")
        return out


def quant_kernel(isa: str) -> QuantCPU | None:
    lib = library(isa)
    return None if lib is None else QuantCPU(isa, lib)
