"""Products with weights kept in GGUF's block formats, on every CPU (`quant_gemm.cpp`, built per
instruction set by `cpu_isa`). A weight is laid out once, when the model loads, in tiles of 16
outputs side by side (the same quants and scales); each forward decodes a block once for all the
rows of x (in registers for a few rows, into float32 scratch for many), so verifying a draft adds
only its multiply-adds to what decoding one token costs; a row's result does not depend on the
other rows, and the AVX-512 and AVX2 builds give the same bits.
"""

from __future__ import annotations

import ctypes
from typing import ClassVar

import torch
from torch import Tensor

from specdecode.kernels.base import GGUF_LAYOUT, QUANT_FORMATS, QuantPart, QuantWeight
from specdecode.kernels.cpu_isa import library

LAYOUT = "tiles32"  # quant_gemm.cpp's: 32 outputs interleaved block by block (the same on every build)


class QuantCPU:
    """The quantized products of one instruction set's build (see the module doc)."""

    formats: ClassVar[frozenset[str]] = frozenset(QUANT_FORMATS)
    layout: ClassVar[str] = LAYOUT

    def __init__(self, isa: str, lib: ctypes.CDLL) -> None:
        self.isa, self._lib = isa, lib
        self.name = f"cpu-quant-{isa}"

    def pack(self, weight: QuantWeight) -> QuantWeight:
        if weight.layout != GGUF_LAYOUT:
            raise ValueError(f"{self.name}: cannot pack a weight laid out as {weight.layout}")
        parts = []
        k = weight.in_features
        for part in _merged(weight.parts):
            fmt = QUANT_FORMATS[part.format][0]
            size = self._lib.specdecode_qpacked_bytes(fmt, part.rows, k)
            if size < 0:
                raise ValueError(f"{self.name}: cannot read {part.format} rows of {k} weights")
            src = part.data.contiguous()
            out = torch.empty(size, dtype=torch.uint8)
            self._lib.specdecode_qpack(fmt, src.data_ptr(), part.rows, k, out.data_ptr())
            parts.append(QuantPart(part.format, out, LAYOUT, part.rows))
        return QuantWeight(k, tuple(parts))

    def _check(self, weight: QuantWeight) -> None:
        if weight.layout != LAYOUT:
            raise ValueError(f"{self.name} takes weights packed by it, not laid out as {weight.layout}")

    def matmul(self, x: Tensor, weight: QuantWeight, bias: Tensor | None = None) -> Tensor:
        self._check(weight)
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
        self._check(weight)
        ids = ids.reshape(-1).to(torch.int64)  # (n,)
        out = torch.empty(ids.numel(), weight.in_features)  # (n, in)
        if len(weight.parts) == 1:  # an embedding: one part
            self._rows(weight.parts[0], weight.in_features, ids.contiguous(), out)
            return out
        first = 0
        for part in weight.parts:  # the ids each part holds, read from it
            mine = (ids >= first) & (ids < first + part.rows)
            if bool(mine.any()):
                got = torch.empty(int(mine.sum()), weight.in_features)
                self._rows(part, weight.in_features, (ids[mine] - first).contiguous(), got)
                out[mine] = got
            first += part.rows
        return out

    def _rows(self, part: QuantPart, k: int, ids: Tensor, out: Tensor) -> None:
        """Rows `ids` (n,) of one packed part into out (n, k)."""
        fmt, n = QUANT_FORMATS[part.format][0], ids.numel()
        if self._lib.specdecode_qrows(fmt, part.data.data_ptr(), k, ids.data_ptr(), n, out.data_ptr()):
            raise ValueError(f"{self.name}: cannot read {part.format} rows of {k} weights")

    def dequantize(self, weight: QuantWeight) -> Tensor:
        return self.rows(weight, torch.arange(weight.out_features)).t()  # (in, out)


def _merged(parts: tuple[QuantPart, ...]) -> list[QuantPart]:
    """Neighbouring GGUF parts in one format as one part (q|k|v in one format: one call a product,
    not three)."""
    out: list[QuantPart] = []
    for part in parts:
        if out and out[-1].format == part.format:
            last = out.pop()
            part = QuantPart(part.format, torch.cat([last.data, part.data]))
        out.append(part)
    return out


def quant_kernel(isa: str) -> QuantCPU | None:
    lib = library(isa)
    return None if lib is None else QuantCPU(isa, lib)
