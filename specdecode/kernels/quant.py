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

from specdecode.kernels.base import (
    GGUF_LAYOUT,
    QUANT_FORMATS,
    WORDS,
    QuantPart,
    QuantWeight,
    kernel_format,
)
from specdecode.kernels.cpu_isa import (
    DECODING,
    EXACT_PREFILL,
    INT8_DECODING,
    INT8_PREFILL,
    UNIT,
    layout,
    library,
)


class QuantCPU:
    """The quantized products of one instruction set's build (see the module doc). `decoding` and
    `prefill` are the arithmetic of decoding rows and prompt rows: a target's (float32
    activations, each decoding row's result the same in any batch) or a draft's (`approximate`:
    int8 activations rounded per group of 32)."""

    formats: ClassVar[frozenset[str]] = frozenset(QUANT_FORMATS)

    def __init__(
        self, isa: str, lib: ctypes.CDLL, decoding: int = DECODING, prefill: int = EXACT_PREFILL
    ) -> None:
        self.isa, self._lib, self.decoding, self.prefill = isa, lib, decoding, prefill
        # The build's own (weights it packs run on it, and its kind, only): its int8 rows' may
        # hold the 4-bit quants another way than its float rows' (AVX2: words, byte pairs).
        self.layout = layout(lib, int8=decoding == INT8_DECODING)
        self._siblings = {layout(lib), layout(lib, int8=True)} - {self.layout}
        self.name = f"cpu-quant-{isa}" + ("-int8" if prefill == INT8_PREFILL else "")

    def approximate(self) -> QuantCPU:
        """These products with their rows read in int8 (see `quant_gemm.cpp`; a draft's, or a
        target's with int8 activations): prompt rows (~2.5x faster prefill with AVX512-VNNI)
        and, for Q4_0, Q4_1, Q4_K, Q6_K and Q8_0 on AVX-512 and AVX2, decoding rows; the others keep
        the float decoding rows. On AVX2 its layout holds the 4-bit quants in words, which its
        int8 rows read in fewer operations (the float rows' byte pairs are faster for them):
        `pack` lays out a weight packed by either for the other."""
        return QuantCPU(self.isa, self._lib, INT8_DECODING, INT8_PREFILL)

    def repacks(self, layout: str) -> bool:
        return layout == GGUF_LAYOUT or layout in self._siblings

    def pack(self, weight: QuantWeight) -> QuantWeight:
        if weight.layout == self.layout:
            return weight
        if weight.layout in self._siblings:
            return self._relayout(weight)
        if weight.layout != GGUF_LAYOUT:
            raise ValueError(f"{self.name}: cannot pack a weight laid out as {weight.layout}")
        k = weight.in_features
        packed = []
        for group in _mergeable(weight.parts):
            fmt = kernel_format(group[0].format, self.layout)
            rows = sum(p.rows for p in group)
            size = self._lib.specdecode_qpacked_bytes(fmt, rows, k)
            if size < 0:
                raise ValueError(f"{self.name}: cannot read {group[0].format} rows of {k} weights")
            out = torch.empty(size, dtype=torch.uint8)
            at = 0  # each part's units follow the last's: no concatenated copy is made
            for part in group:
                src = part.data.contiguous()
                self._lib.specdecode_qpack(fmt, src.data_ptr(), part.rows, k, out.data_ptr() + at)
                at += self._lib.specdecode_qpacked_bytes(fmt, part.rows, k)
            packed.append(QuantPart(group[0].format, out, self.layout, rows))
        return QuantWeight(k, tuple(packed))

    def _relayout(self, weight: QuantWeight) -> QuantWeight:
        """A weight packed in a sibling layout -> this one: the 4-bit formats' quants laid out
        anew (a copy), the others' bytes the same in both (shared)."""
        k, parts = weight.in_features, []
        for part in weight.parts:
            data, fmt = part.data, kernel_format(part.format, self.layout)
            if fmt != kernel_format(part.format, part.layout):  # its quants are laid out differently
                src, data = part.data.contiguous(), torch.empty_like(part.data)
                if self._lib.specdecode_qrelayout(fmt, src.data_ptr(), part.rows, k, data.data_ptr()):
                    raise ValueError(f"{self.name}: cannot lay out {part.format} rows of {k} weights anew")
            parts.append(QuantPart(part.format, data, self.layout, part.rows))
        return QuantWeight(k, tuple(parts))

    def _check(self, weight: QuantWeight) -> None:
        if weight.layout != self.layout:
            raise ValueError(f"{self.name} takes weights packed by it, not laid out as {weight.layout}")

    def matmul(
        self, x: Tensor, weight: QuantWeight, bias: Tensor | None = None, prefill: bool = False
    ) -> Tensor:
        self._check(weight)
        if x.dtype is not torch.float32 or x.requires_grad or not x.is_contiguous():
            x = x.detach().float().contiguous()  # (M, in)
        m, k = x.shape
        n = weight.out_features
        y = torch.empty(m, n)  # (M, out)
        if m:
            threads, xp, yp = torch.get_num_threads(), x.data_ptr(), y.data_ptr()
            how = self.prefill if prefill else self.decoding
            for fmt, data, rows, first in weight.calls:
                if self._lib.specdecode_qmm(fmt, xp, m, k, data, rows, yp + 4 * first, n, threads, how):
                    name = next(f for f, (i, _, _) in QUANT_FORMATS.items() if i == fmt & ~WORDS)
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
        fmt, n = kernel_format(part.format, part.layout), ids.numel()
        if self._lib.specdecode_qrows(fmt, part.data.data_ptr(), k, ids.data_ptr(), n, out.data_ptr()):
            raise ValueError(f"{self.name}: cannot read {part.format} rows of {k} weights")

    def dequantize(self, weight: QuantWeight) -> Tensor:
        return self.rows(weight, torch.arange(weight.out_features)).t()  # (in, out)

    def first_outputs(self, weight: QuantWeight, n: int) -> QuantWeight | None:
        # Units of 32 outputs follow each other in a part: the first n/32 are a prefix of its bytes.
        self._check(weight)
        first = weight.parts[0]
        if not 0 < n <= first.rows or (n % UNIT and n != first.rows):
            return None
        fmt = kernel_format(first.format, first.layout)
        size = self._lib.specdecode_qpacked_bytes(fmt, n, weight.in_features)
        return QuantWeight(weight.in_features, (QuantPart(first.format, first.data[:size], self.layout, n),))


def _mergeable(parts: tuple[QuantPart, ...]) -> list[list[QuantPart]]:
    """The parts in groups packed as one (one product a group, not one a part): neighbours in one
    format, each but the last a whole number of units (32 outputs), so each packs on its own
    into its place (q|k|v of SmolLM2: one product)."""
    groups: list[list[QuantPart]] = []
    for part in parts:
        last = groups[-1] if groups else None
        if last is not None and last[-1].format == part.format and last[-1].rows % UNIT == 0:
            last.append(part)
        else:
            groups.append([part])
    return groups


def quant_kernel(isa: str) -> QuantCPU | None:
    lib = library(isa)
    return None if lib is None else QuantCPU(isa, lib)
