"""The linear layer, the embedding and the RMS norm, through the kernels bound to them."""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.kernels import (
    GGUF_LAYOUT,
    REFERENCE,
    TORCH_LINEAR,
    Kernels,
    LinearKernel,
    QuantKernel,
    QuantWeight,
    dequantize,
    quantize,
)

# A product of more rows than this whose caller does not say which are a prompt's is taken as one
# (a prefill): a draft model's or a head's own forwards, the model outside the engine.
PREFILL_ROWS = 64


def prefill_rows(rows: int, prefill_from: int | None) -> int:
    """Where a product's prompt rows start: rows before are a decoding step's (verified drafts,
    roots), which must get the same result in any batch; rows after are prefilled, which the
    quantized kernels compute with the arithmetic fastest for many rows."""
    if prefill_from is None:
        return 0 if rows > PREFILL_ROWS else rows
    return min(max(prefill_from, 0), rows)


class Dense(nn.Module):
    """y = x @ W (+ bias). W is created (in, out) as `weight_t`, the reference kernel's layout;
    `bind_kernels` re-stores it once, frozen, in the layout of the kernel that takes it, as
    `weight_packed` (one copy of the weights, not two).

    A weight loaded as stored in a GGUF (`load_quantized`) stays in its block formats where the
    kernels have a quantized product (float32 activations and sums); elsewhere binding
    dequantizes it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features).normal_(0, 0.02))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.register_parameter("weight_packed", None)
        self.kernel: LinearKernel | QuantKernel = TORCH_LINEAR
        self.quantized: QuantWeight | None = None

    def load_quantized(self, weight: QuantWeight) -> None:
        """Hold `weight` as stored (its float parameter goes); `bind_kernels` decides how it runs."""
        if (weight.in_features, weight.out_features) != tuple(self.weight_t.shape):
            raise ValueError(
                f"quantized weight {weight.in_features} x {weight.out_features} for a layer of "
                f"{tuple(self.weight_t.shape)}"
            )
        del self.weight_t
        self.quantized = weight

    def quantize(self, fmt: str) -> None:
        """Hold a float weight in the blocks of `fmt` from now on (a drafter head run beside a
        target that runs as stored: drafts need plausible guesses, and a head's bytes are read
        once per depth). Inputs that are not whole blocks stay float."""
        if self.quantized is None and self.weight_packed is None and self.weight_t.shape[0] % 32 == 0:
            self.load_quantized(quantize(self.weight_t, fmt))

    def bind_kernels(self, kernels: Kernels, pack: bool = True) -> None:
        """Compute through `kernels`; with `pack` False a float weight stays (in, out) (the LM
        head, which drafters and training read)."""
        if self.quantized is not None:
            quant = kernels.quant
            if quant is not None and all(p.format in quant.formats for p in self.quantized.parts):
                if self.quantized.layout != quant.layout and quant.repacks(self.quantized.layout):
                    self.quantized = quant.pack(self.quantized)  # from the GGUF's layout or a sibling's
                if self.quantized.layout == quant.layout:  # packed by a build of this layout
                    self.kernel = quant
                    return
            self.weight_t = nn.Parameter(self.matrix(), requires_grad=False)
            self.quantized, self.kernel = None, TORCH_LINEAR
        if not pack:
            return
        weight_t = self.matrix().detach()
        kernel = kernels.linear_for(weight_t)
        if kernel.name == self.kernel.name:
            return
        packed = kernel.pack(weight_t)
        if hasattr(self, "weight_t"):
            del self.weight_t
        self.weight_packed = nn.Parameter(packed, requires_grad=False)
        self.kernel = kernel

    def matrix(self) -> torch.Tensor:
        """The weight as (in, out), whichever way it is stored (a copy when packed or quantized)."""
        if self.quantized is not None:
            if self.quantized.layout == GGUF_LAYOUT:
                return dequantize(self.quantized)
            return self.kernel.dequantize(self.quantized)  # type: ignore[union-attr]
        if self.weight_packed is None:
            return self.weight_t
        return self.kernel.unpack(self.weight_packed)  # type: ignore[union-attr]

    def columns(self, ids: torch.Tensor) -> torch.Tensor:
        """Outputs `ids` (n,) of the weight as (in, n) float: read row by row where it is held
        packed in block formats (no copy of the whole matrix)."""
        if self.quantized is not None and self.quantized.layout != GGUF_LAYOUT:
            return self.kernel.rows(self.quantized, ids.long().contiguous()).t()  # type: ignore[union-attr]
        return self.matrix()[:, ids]

    def forward(self, x: torch.Tensor, prefill_from: int | None = None) -> torch.Tensor:
        # x (..., in) -> (..., out). Rows from `prefill_from` on are a prompt's (see `prefill_rows`).
        flat = x.reshape(-1, x.shape[-1])
        if self.quantized is not None:
            y = self._stored_product(flat, prefill_from)
        else:
            weight = self.weight_t if self.weight_packed is None else self.weight_packed
            y = self.kernel.matmul(flat, weight, self.bias)  # type: ignore[arg-type]
        return y.view(*x.shape[:-1], y.shape[-1])

    def _stored_product(self, flat: torch.Tensor, prefill_from: int | None) -> torch.Tensor:
        """The quantized product, decoding rows and prefill rows each with their own arithmetic."""
        quant, weight = cast(QuantKernel, self.kernel), self.quantized
        assert weight is not None
        p = prefill_rows(flat.shape[0], prefill_from)
        if p == flat.shape[0]:
            return quant.matmul(flat, weight, self.bias)
        if p == 0:
            return quant.matmul(flat, weight, self.bias, prefill=True)
        decode = quant.matmul(flat[:p], weight, self.bias)
        return torch.cat([decode, quant.matmul(flat[p:], weight, self.bias, prefill=True)])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = REFERENCE

    def bind_kernels(self, kernels: Kernels) -> None:
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)


class Embedding(nn.Module):
    """Token ids -> their rows of the (vocab, C) embedding matrix: a float `weight`, or a matrix
    held as stored in a GGUF's block formats (`load_stored`: a `Dense` whose outputs are the
    tokens, the LM head itself for a tied model), read row by row through its quantized kernel:
    the same values as its dequantized copy, without holding one (4 to 7 times the bytes)."""

    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(num_embeddings, dim).normal_(0, 1))
        self._stored: list[Dense] = []  # a plain list: not a submodule of ours (a tied one is the head)

    @property
    def stored(self) -> Dense | None:
        return self._stored[0] if self._stored else None

    def load_stored(self, dense: Dense) -> None:
        """Read rows from `dense`'s stored weight (in = C, out = vocab); the float weight goes."""
        self.weight = None
        self._stored = [dense]

    def bind_kernels(self, kernels: Kernels) -> None:
        dense = self.stored
        if dense is None:
            return
        dense.bind_kernels(kernels, pack=False)
        if dense.quantized is None:  # no quantized kernels here: the matrix is float after all
            self.weight = nn.Parameter(dense.matrix().detach().t().contiguous(), requires_grad=False)
            self._stored = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids (...) long -> (..., C)
        dense = self.stored
        if dense is None:
            assert self.weight is not None
            return F.embedding(ids, self.weight)
        assert dense.quantized is not None, "a stored embedding is read once its kernels are bound"
        rows = dense.kernel.rows(dense.quantized, ids.reshape(-1))  # type: ignore[union-attr]
        return rows.view(*ids.shape, -1)

    def matrix(self) -> torch.Tensor:
        """The (vocab, C) matrix (a dequantized copy where it is stored)."""
        dense = self.stored
        if dense is None:
            assert self.weight is not None
            return self.weight
        return dense.matrix().t()
