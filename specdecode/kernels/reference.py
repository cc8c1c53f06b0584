"""PyTorch's own ops behind the kernel interface: any device, any dtype, and autograd.

This is what runs where no faster kernel does (a GPU today, a CPU without our kernels, training),
and what the faster kernels are tested against."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from specdecode.kernels.base import GGUF_LAYOUT, Kernels, QuantPart, QuantWeight


class TorchLinear:
    """W kept as (in, out): for the few rows of decoding, `x @ W_t` runs up to 2x faster on CPU
    than `F.linear(x, W)` with the (out, in) layout (MKL, this project's machines)."""

    name: ClassVar[str] = "torch"
    rounds_output: ClassVar[bool] = False

    def accepts(self, weight_t: Tensor) -> bool:
        return True

    def pack(self, weight_t: Tensor) -> Tensor:
        return weight_t

    def unpack(self, packed: Tensor) -> Tensor:
        return packed

    def matmul(self, x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
        return x @ packed if bias is None else torch.addmm(bias, x, packed)


class TorchApprox:
    """The approximate product in bfloat16 through PyTorch (oneDNN on CPU), W held (out, in):
    outputs come back rounded to bfloat16 too."""

    name: ClassVar[str] = "torch-bf16"
    rounds_output: ClassVar[bool] = True

    def accepts(self, weight_t: Tensor) -> bool:
        return weight_t.is_floating_point()

    def pack(self, weight_t: Tensor) -> Tensor:
        return weight_t.detach().t().bfloat16().contiguous()  # (out, in)

    def unpack(self, packed: Tensor) -> Tensor:
        return packed.t()

    def matmul(self, x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
        y = F.linear(x.to(packed.dtype), packed).float()
        return y if bias is None else y + bias


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding over the two halves of each head: x (..., T, D) with cos/sin (T, D), or
    any shapes that broadcast so ((B, H, T, D) with (B, 1, T, D))."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x (..., C) normalised by its root mean square and scaled by `weight` (C,). In bfloat16 and
    float16: normalised in float32, rounded to x's dtype, then scaled, as the reference
    implementations (transformers') do."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_mul(gate_up: Tensor) -> Tensor:
    """(..., 2 I) -> SiLU(gate) * up (..., I), the SwiGLU MLP's middle."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# On a CPU the approximate bfloat16 product halves the LM head's bytes for the greedy screen; on
# an accelerator the exact product is as cheap, so `EXACT` offers none.
TORCH_LINEAR = TorchLinear()  # the layers' kernel until one is bound, and every set's last resort
REFERENCE = Kernels("torch", (TORCH_LINEAR,), (TorchApprox(),), rms_norm, silu_mul)
EXACT = Kernels("torch-exact", (TORCH_LINEAR,), (), rms_norm, silu_mul)


def dequantize(weight: QuantWeight) -> Tensor:
    """A weight kept in GGUF block formats -> (in, out) float32, by gguf-py (the reference the
    quantized kernels are tested against, and the fallback where they cannot run). The weight
    must be in the GGUF layout."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    if weight.layout != GGUF_LAYOUT:
        raise ValueError(f"gguf-py cannot read a weight laid out as {weight.layout}")
    parts = [
        np.asarray(gguf_dequantize(p.data.numpy(), GGMLQuantizationType[p.format]), dtype=np.float32)
        for p in weight.parts
    ]  # (rows, in) each
    return torch.from_numpy(np.concatenate(parts)).t()  # (in, out)


def quantize(weight_t: Tensor, fmt: str) -> QuantWeight:
    """An (in, out) float weight -> the blocks of `fmt` (a GGUF type name, e.g. "q8_0") along
    `in`, in the GGUF layout, by gguf-py's quantizer (the one llama.cpp's conversion writes files
    with). `in` must be whole blocks."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    kind = GGMLQuantizationType[fmt.upper()]
    rows = weight_t.detach().t().float().contiguous().cpu().numpy()  # (out, in)
    blocks = np.ascontiguousarray(gguf_quantize(rows, kind))  # (out, row bytes) uint8
    return QuantWeight(int(weight_t.shape[0]), (QuantPart(fmt.upper(), torch.from_numpy(blocks)),))
