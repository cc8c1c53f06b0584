"""Products with weights kept in GGUF's block formats, on every CPU (`quant_gemm.cpp`, built per
instruction set by `cpu_isa`). Each forward decodes a weight block once for all the rows of x
(in registers for a few rows, into float32 scratch for many), so verifying a draft adds only its
multiply-adds to what decoding one token costs; a row's result does not depend on the other
rows, and the AVX-512 and AVX2 builds give the same bits.
"""

from __future__ import annotations

import ctypes
from typing import ClassVar

import torch
from torch import Tensor

from specdecode.kernels.base import QUANT_FORMATS, QuantWeight
from specdecode.kernels.cpu_isa import library


class QuantCPU:
    """The quantized products of one instruction set's build (see the module doc)."""

    formats: ClassVar[frozenset[str]] = frozenset(QUANT_FORMATS)

    def __init__(self, isa: str, lib: ctypes.CDLL) -> None:
        self.isa, self._lib = isa, lib
        self.name = f"cpu-quant-{isa}"

    def matmul(self, x: Tensor, weight: QuantWeight, bias: Tensor | None = None) -> Tensor:
        if x.dtype is not torch.float32 or x.requires_grad or not x.is_contiguous():
            x = x.detach().float().contiguous()  # (M, in)
        m, k = x.shape
        n = weight.out_features
        y = torch.empty(m, n)  # (M, out)
        if m:
            threads, xp, yp = torch.get_num_threads(), x.data_ptr(), y.data_ptr()
            for fmt, data, rows, first in weight.calls:
                if self._lib.specdecode_qmm(fmt, xp, m, k, data, rows, yp + 4 * first, n, threads) != 0:
                    name = next(f for f, (i, _, _) in QUANT_FORMATS.items() if i == fmt)
                    raise ValueError(f"{self.name}: cannot multiply {name} rows of {k} weights")
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
