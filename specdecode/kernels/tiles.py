"""Float weights in 32-column tiles, the layout of the few-row products of `tiles.cpp`.

Why: speculative decoding verifies a handful of tokens per forward and is worth it only when
that forward costs about as much as a one-token one. MKL's `x @ W` for 4-16 rows costs 1.7-2.8x
one row in float32 (measured on SmolLM2-135M's shapes) and rounds a row by how many rows its step
has; `tiles.cpp` reads each weight once for a block of rows and sums each output over k in
order, so a row's result is the same alone or in any batch. Its products are reached through
`cpu_isa` (the ctypes side) and the kernel interface (`kernels/cpu.py`); this module lays weights
out for them and holds PyTorch's product over the same layout, for many rows and for autograd.
"""

from __future__ import annotations

import torch

TILE = 32
# Rows up to which our kernels beat PyTorch's matmul (measured on SmolLM2's shapes): float32 runs
# every block of rows over a tile while it is in L2; a bfloat16 model's layers go to oneDNN past
# MAX_KERNEL_ROWS_BF16 (a prefill chunk: it blocks over many rows far better).
MAX_KERNEL_ROWS = 64
MAX_KERNEL_ROWS_BF16 = 24
BF16_CALL_ROWS = 64 * 12  # the most rows one call of the bf16 kernel takes (64 blocks of 12)


def tile_weight(weight_t: torch.Tensor) -> torch.Tensor:
    """(K, N) -> (N / 32, K, 32): each 32-column tile made one contiguous block."""
    k, n = weight_t.shape
    return weight_t.reshape(k, n // TILE, TILE).permute(1, 0, 2).contiguous()


def untile_weight(tiled: torch.Tensor) -> torch.Tensor:
    """(N / 32, K, 32) -> (K, N), the inverse of `tile_weight`."""
    t, k, w = tiled.shape
    return tiled.permute(1, 0, 2).reshape(k, t * w)


def torch_matmul(x: torch.Tensor, tiled: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ W for W tiled as (N / 32, K, 32) by PyTorch's batched matmul over the tiles:
    as fast as `x @ W` for many rows, differentiable; returns (M, N)."""
    m = x.shape[0]
    t, _, w = tiled.shape
    return torch.matmul(x, tiled).permute(1, 0, 2).reshape(m, t * w)  # (T, M, 32) -> (M, N)


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
