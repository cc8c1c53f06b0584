"""Our CPU kernels behind the kernel interface (the compiled functions: `cpu_gemm` for AVX-512's
float tiles, `cpu_isa` for everything built per instruction set).

- `TiledF32`: float32 weights in 32-column tiles, each read once for up to 12 rows, so a forward
  over the handful of tokens a speculative step verifies costs about what a one-token forward
  does; a row's products do not depend on the other rows.
- `TiledBF16`: weights rounded to bfloat16 in the bf16 kernel's tiles (AVX512_BF16): the
  approximate product of drafts and of the greedy screen, float32 sums at any row count (the
  screen's error bound counts on them). At 64 rows it reads the LM head in a quarter of the
  time of the float32 product.
- `BF16Layers`: a bfloat16 model's layers in the same tiles: the kernel for a few rows, oneDNN for
  a prefill chunk (it blocks over many rows far better).
- below AVX-512 (`IsaTiledF32`, `IsaBF16Layers`): the float32 tiles built per instruction set
  (`cpu_isa.FloatTiles`, the same sums as AVX-512's), a bfloat16 model's weights widened into
  them: there too a row's products do not depend on the other rows.
- per instruction set (`cpu_isa`): the fused RMS norm, the row-attention kernel and the products
  of weights kept in GGUF block formats.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import ClassVar

import torch
from torch import Tensor

from specdecode.kernels import cpu_gemm
from specdecode.kernels.base import Kernels
from specdecode.kernels.cpu_isa import FloatTiles, decoder_rows, float_tiles, probe, row_ops
from specdecode.kernels.quant import quant_kernel
from specdecode.kernels.reference import REFERENCE, TorchApprox


class TiledF32:
    name: ClassVar[str] = "cpu-f32-tiles"
    rounds_output: ClassVar[bool] = False

    def accepts(self, weight_t: Tensor) -> bool:
        return weight_t.dtype == torch.float32 and weight_t.is_cpu and weight_t.shape[1] % cpu_gemm.TILE == 0

    def pack(self, weight_t: Tensor) -> Tensor:
        return cpu_gemm.tile_weight(weight_t.detach())  # (N/32, K, 32)

    def unpack(self, packed: Tensor) -> Tensor:
        return cpu_gemm.untile_weight(packed)

    def matmul(self, x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
        y = cpu_gemm.tiled_matmul(x, packed)
        if bias is not None:
            y += bias
        return y


class IsaTiledF32(TiledF32):
    """`TiledF32` on an instruction set below AVX-512 (`cpu_isa.FloatTiles`: AVX2, plain C++):
    the same tiles and sums, so the same bits; PyTorch's product past `MAX_KERNEL_ROWS` rows."""

    name: ClassVar[str] = "cpu-f32-tiles-isa"

    def __init__(self, tiles: FloatTiles) -> None:
        self.tiles = tiles

    def matmul(self, x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
        m = x.shape[0]
        if (
            0 < m <= cpu_gemm.MAX_KERNEL_ROWS
            and x.dtype is torch.float32
            and not (torch.is_grad_enabled() and (x.requires_grad or packed.requires_grad))
        ):
            y = self.tiles(x, packed)
        else:
            y = cpu_gemm.tiled_matmul(x, packed)
        if bias is not None:
            y += bias
        return y


class IsaBF16Layers(IsaTiledF32):
    """A bfloat16 model's layers where the CPU has no AVX512_BF16 kernel (AVX2, plain C++): its
    weights widened to float32 in the same tiles (twice the bytes, the same values), the rows'
    sums in float32 and rounded to bfloat16 once; a row's result does not depend on the other
    rows, as oneDNN's bfloat16 product's does. oneDNN's past `MAX_KERNEL_ROWS_BF16` rows."""

    name: ClassVar[str] = "cpu-bf16-layers-isa"

    def accepts(self, weight_t: Tensor) -> bool:
        return weight_t.dtype == torch.bfloat16 and weight_t.is_cpu and weight_t.shape[1] % cpu_gemm.TILE == 0

    def pack(self, weight_t: Tensor) -> Tensor:
        return cpu_gemm.tile_weight(weight_t.detach().float())  # (N/32, K, 32) float32

    def unpack(self, packed: Tensor) -> Tensor:
        return cpu_gemm.untile_weight(packed).bfloat16()  # exact: the values were bfloat16

    def matmul(self, x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
        if x.shape[0] <= cpu_gemm.MAX_KERNEL_ROWS_BF16:
            y = super().matmul(x.float(), packed).to(x.dtype)
        else:  # a prefill chunk (oneDNN reads the bfloat16 weights, half the bytes)
            y = x @ self.unpack(packed)
        if bias is not None:
            y += bias
        return y


class TiledBF16:
    name: ClassVar[str] = "cpu-bf16-tiles"
    rounds_output: ClassVar[bool] = False

    def accepts(self, weight_t: Tensor) -> bool:
        k, n = weight_t.shape
        return weight_t.is_floating_point() and weight_t.is_cpu and n % cpu_gemm.TILE == 0 and k % 2 == 0

    def pack(self, weight_t: Tensor) -> Tensor:
        return cpu_gemm.tile_weight_bf16(weight_t.detach())  # (N/32, K/2, 32, 2) bfloat16

    def unpack(self, packed: Tensor) -> Tensor:
        return cpu_gemm.untile_weight_bf16(packed)

    def matmul(self, x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
        y = cpu_gemm.tiled_matmul_bf16(x, packed)  # (M, N) float32 sums
        if bias is not None:
            y += bias
        return y


class BF16Layers(TiledBF16):
    """The same tiles for a bfloat16 model's own layers (bfloat16 weights only), in its dtype."""

    name: ClassVar[str] = "cpu-bf16-layers"

    def accepts(self, weight_t: Tensor) -> bool:
        return weight_t.dtype == torch.bfloat16 and super().accepts(weight_t)

    def matmul(self, x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
        if x.shape[0] <= cpu_gemm.MAX_KERNEL_ROWS_BF16:
            y = super().matmul(x, packed).to(x.dtype)
        else:  # a prefill chunk: oneDNN's bf16 matmul
            y = x.to(torch.bfloat16) @ cpu_gemm.untile_weight_bf16(packed)
        if bias is not None:
            y += bias
        return y


@functools.cache
def cpu_kernels(isa: str) -> Kernels:
    """Our CPU kernels for the instruction set `isa` (`build.ISAS`), PyTorch's where ours cannot
    be had here (no compiler). Every set has our RMS norm, row attention and products of weights
    kept in GGUF block formats; the float32 tiles need AVX-512, and bfloat16 weights and the
    approximate product use the bf16 kernel where the CPU has AVX512_BF16, else PyTorch's
    bfloat16 matmul."""
    ops = row_ops(isa)
    if ops is None:
        return REFERENCE
    quant = quant_kernel(isa)
    machine = probe(isa)
    decoder = decoder_rows(isa)
    if isa != "avx512" or cpu_gemm.kernel() is None:
        tiles = float_tiles(isa)
        ours = () if tiles is None else (IsaTiledF32(tiles), IsaBF16Layers(tiles))
        linears = (*ours, *REFERENCE.linears)
        return replace(
            REFERENCE, name=f"cpu-{isa}", linears=linears, rms_norm=ops.rms_norm, silu_mul=ops.silu_mul,
            attend_rows=ops, quant=quant, probe=machine, decoder=decoder,
        )  # fmt: skip
    bf16 = cpu_gemm.kernel_bf16() is not None
    linears = (TiledF32(), BF16Layers()) if bf16 else (TiledF32(),)
    approx = (TiledBF16(), TorchApprox()) if bf16 else (TorchApprox(),)
    linears = (*linears, *REFERENCE.linears)
    return Kernels(
        "cpu-avx512", linears, approx, ops.rms_norm, ops.silu_mul, ops, bf16, quant, machine, decoder
    )
