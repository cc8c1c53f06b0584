"""The kernel boundary: every layer of a model computes through one `Kernels`, chosen at load time.

A `Kernels` names what a layer needs and nothing about the model: linear products over weights in
a layout the kernel chose (`LinearKernel`: pack once, multiply many times), an RMS norm, attention
over listed cache slots, and the approximate (bfloat16) product drafts and the greedy screen use.
`select` picks one for a device and dtype once; the layers hold it and never look at the CPU, the
dtype or a library again. Three exist today:

- `REFERENCE` / `EXACT`: PyTorch's own ops, on any device and dtype (what the CPU kernels fall
  back to and are tested against), with and without an approximate bfloat16 product;
- the CPU kernels (`cpu.py`, over the ctypes library of `cpu_isa.py`), built per instruction
  set where the CPU and a compiler allow: few-row float32 matmuls on 32-column tiles (bfloat16
  ones with AVX512_BF16), a fused RMS norm, row attention and products of weights kept in GGUF
  block formats;
- the GPU's (`cuda.py`): PyTorch's ops with rows padded so that a row's products do not depend
  on the forward's size, a Triton row attention, and a probe of the card's bounds.

Nothing outside this package calls a compiled library, the C library's `malloc_trim` included
(`memory.py`: the heap's freed pages handed back once a model's weights are laid out).
"""

from __future__ import annotations

import os

import torch

from specdecode.errors import SpecDecodeError
from specdecode.kernels.base import (
    GGUF_LAYOUT,
    QUANT_FORMATS,
    AttendRows,
    DecoderRows,
    Kernels,
    LayerWeights,
    LinearKernel,
    QuantKernel,
    QuantPart,
    QuantWeight,
)
from specdecode.kernels.memory import return_freed_memory
from specdecode.kernels.reference import EXACT, REFERENCE, TORCH_LINEAR, apply_rotary, dequantize, quantize

__all__ = [
    "EXACT",
    "GGUF_LAYOUT",
    "QUANT_FORMATS",
    "REFERENCE",
    "TORCH_LINEAR",
    "AttendRows",
    "DecoderRows",
    "Kernels",
    "LayerWeights",
    "LinearKernel",
    "QuantKernel",
    "QuantPart",
    "QuantWeight",
    "apply_rotary",
    "dequantize",
    "quantize",
    "return_freed_memory",
    "select",
]

ENV_SWITCH = "SPECDECODE_CPU_KERNELS"


def select(device: torch.device | str) -> Kernels:
    """The kernels a model on `device` runs on: on a CPU our kernels for the best instruction set
    here (or the one `SPECDECODE_CPU_ISA` forces), where a compiler is to be had and
    `SPECDECODE_CPU_KERNELS` is not 0, else PyTorch's; on a GPU PyTorch's exact ops with the
    card's probe; elsewhere PyTorch's exact ops."""
    device = torch.device(device)
    if device.type == "cuda":
        from specdecode.kernels.cuda import cuda_kernels

        return cuda_kernels()
    if device.type != "cpu":
        return EXACT
    switch = os.environ.get(ENV_SWITCH, "1")
    if switch not in ("0", "1"):
        raise SpecDecodeError(f"{ENV_SWITCH} must be 0 or 1, not {switch!r}")
    from specdecode.kernels import build

    isa = build.best_isa()  # raises for a bad or unrunnable SPECDECODE_CPU_ISA
    if switch == "0" or isa is None:
        return REFERENCE
    from specdecode.kernels.cpu import cpu_kernels

    return cpu_kernels(isa)
