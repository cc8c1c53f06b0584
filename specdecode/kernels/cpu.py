"""Our CPU kernels behind the kernel interface (the compiled functions are `cpu_isa`'s, built
per instruction set).

- `TiledF32`: float32 weights in 32-column tiles (`tiles.cpp`), each read once for a block of
  rows, so a forward over the handful of tokens a speculative step verifies costs about what a
  one-token forward does; a row's products do not depend on the other rows, and are the same on
  AVX-512 and AVX2.
- `TiledBF16`: weights rounded to bfloat16 in the bf16 kernel's tiles (AVX512_BF16): the
  approximate product of drafts and of the greedy screen, float32 sums at any row count (the
  screen's error bound counts on them). At 64 rows it reads the LM head in a quarter of the
  time of the float32 product.
- `BF16Layers`: a bfloat16 model's layers in the same tiles: the kernel for a few rows, oneDNN for
  a prefill chunk (it blocks over many rows far better); `WidenedBF16Layers` where the CPU has no
  AVX512_BF16: the weights widened into the float32 tiles, so there too a row's products do not
  depend on the other rows.
- per instruction set (`cpu_isa`): the fused RMS norm, the row-attention kernel and the products
  of weights kept in GGUF block formats.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import ClassVar

import torch
from torch import Tensor

from specdecode.kernels import tiles
from specdecode.kernels.base import Kernels
from specdecode.kernels.cpu_isa import (
    BF16Tiles,
    FloatTiles,
    bf16_tiles,
    decoder_rows,
    float_tiles,
    probe,
    row_ops,
)
from specdecode.kernels.quant import quant_kernel
from specdecode.kernels.reference import REFERENCE, TorchApprox


class TiledF32:
    """float32 weights in 32-column tiles, multiplied by one instruction set's `FloatTiles` up to
    `MAX_KERNEL_ROWS` rows, by PyTorch's product past that or where gradients are needed."""

    name: ClassVar[str] = "cpu-f32-tiles"
    rounds_output: ClassVar[bool] = False

    def __init__(self, product: FloatTiles) -> None:
        self.product = product

    def accepts(self, weight_t: Tensor) -> bool:
        return weight_t.dtype == torch.float32 and weight_t.is_cpu and weight_t.shape[1] % tiles.TILE == 0

    def pack(self, weight_t: Tensor) -> Tensor:
        return tiles.tile_weight(weight_t.detach())  # (N/32, K, 32)

    def unpack(self, packed: Tensor) -> Tensor:
        return tiles.untile_weight(packed)

    def matmul(self, x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
        m = x.shape[0]
        if (
            0 < m <= tiles.MAX_KERNEL_ROWS
            and x.dtype is torch.float32
            and x.is_cpu
            and packed.dtype is torch.float32
            and not (torch.is_grad_enabled() and (x.requires_grad or packed.requires_grad))
        ):
            y = self.product(x, packed)
        else:
            y = tiles.torch_matmul(x, packed)
        if bias is not None:
            y += bias
        return y


class WidenedBF16Layers(TiledF32):
    """A bfloat16 model's layers where the CPU has no AVX512_BF16 kernel (AVX2, plain C++, AVX-512
    without BF16): its weights widened to float32 in the same tiles (twice the bytes, the same
    values), the rows' sums in float32 and rounded to bfloat16 once; a row's result does not
    depend on the other rows, as oneDNN's bfloat16 product's does. oneDNN's past
    `MAX_KERNEL_ROWS_BF16` rows."""

    name: ClassVar[str] = "cpu-bf16-widened"

    def accepts(self, weight_t: Tensor) -> bool:
        return weight_t.dtype == torch.bfloat16 and weight_t.is_cpu and weight_t.shape[1] % tiles.TILE == 0

    def pack(self, weight_t: Tensor) -> Tensor:
        return tiles.tile_weight(weight_t.detach().float())  # (N/32, K, 32) float32

    def unpack(self, packed: Tensor) -> Tensor:
        return tiles.untile_weight(packed).bfloat16()  # exact: the values were bfloat16

    def matmul(self, x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
        if x.shape[0] <= tiles.MAX_KERNEL_ROWS_BF16:
            y = super().matmul(x.float(), packed).to(x.dtype)
        else:  # a prefill chunk (oneDNN reads the bfloat16 weights, half the bytes)
            y = x @ self.unpack(packed)
        if bias is not None:
            y += bias
        return y


class TiledBF16:
    name: ClassVar[str] = "cpu-bf16-tiles"
    rounds_output: ClassVar[bool] = False

    def __init__(self, product: BF16Tiles) -> None:
        self.product = product

    def accepts(self, weight_t: Tensor) -> bool:
        k, n = weight_t.shape
        return weight_t.is_floating_point() and weight_t.is_cpu and n % tiles.TILE == 0 and k % 2 == 0

    def pack(self, weight_t: Tensor) -> Tensor:
        return tiles.tile_weight_bf16(weight_t.detach())  # (N/32, K/2, 32, 2) bfloat16

    def unpack(self, packed: Tensor) -> Tensor:
        return tiles.untile_weight_bf16(packed)

    def matmul(self, x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
        y = self.product(x, packed)  # (M, N) float32 sums
        if bias is not None:
            y += bias
        return y


class BF16Layers(TiledBF16):
    """The same tiles for a bfloat16 model's own layers (bfloat16 weights only), in its dtype."""

    name: ClassVar[str] = "cpu-bf16-layers"

    def accepts(self, weight_t: Tensor) -> bool:
        return weight_t.dtype == torch.bfloat16 and super().accepts(weight_t)

    def matmul(self, x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
        if x.shape[0] <= tiles.MAX_KERNEL_ROWS_BF16:
            y = super().matmul(x, packed).to(x.dtype)
        else:  # a prefill chunk: oneDNN's bf16 matmul
            y = x.to(torch.bfloat16) @ tiles.untile_weight_bf16(packed)
        if bias is not None:
            y += bias
        return y


@functools.cache
def cpu_kernels(isa: str) -> Kernels:
    """Our CPU kernels for the instruction set `isa` (`build.ISAS`), PyTorch's where ours cannot
    be had here (no compiler). Every set has our RMS norm, row attention, float32 tiles and
    products of weights kept in GGUF block formats; bfloat16 weights and the approximate product
    use the bf16 kernel where the CPU has AVX512_BF16 (AVX-512's build), else bfloat16 weights are
    widened into the float32 tiles and the approximate product is PyTorch's."""
    ops = row_ops(isa)
    if ops is None:
        return REFERENCE
    product = float_tiles(isa)
    assert product is not None  # the same library as `ops`
    bf16 = bf16_tiles() if isa == "avx512" else None
    linears = (TiledF32(product), BF16Layers(bf16) if bf16 is not None else WidenedBF16Layers(product))
    approx = (TiledBF16(bf16), TorchApprox()) if bf16 is not None else REFERENCE.approx
    return replace(
        REFERENCE, name=f"cpu-{isa}", linears=(*linears, *REFERENCE.linears), approx=approx,
        rms_norm=ops.rms_norm, silu_mul=ops.silu_mul, attend_rows=ops, fast_bf16=bf16 is not None,
        quant=quant_kernel(isa), probe=probe(isa), decoder=decoder_rows(isa),
    )  # fmt: skip
