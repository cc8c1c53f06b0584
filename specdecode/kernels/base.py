"""What a kernel set provides: the interface the layers compute through (see the package doc)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import Tensor


class LinearKernel(Protocol):
    """y = x @ W for a weight W (in, out) held in the kernel's own layout.

    `pack` turns W into that layout once, when a model is loaded; `matmul` runs every forward.
    `rounds_output` says whether the products come back rounded to bfloat16 (oneDNN's bf16
    matmul does), which bounds how far an approximate product may be from the exact one."""

    name: str
    rounds_output: bool

    def accepts(self, weight_t: Tensor) -> bool:
        """Whether `pack` can take this (in, out) weight (shape, dtype, device)."""
        ...

    def pack(self, weight_t: Tensor) -> Tensor:
        """(in, out) -> the kernel's layout. A fresh tensor: the caller drops the original."""
        ...

    def unpack(self, packed: Tensor) -> Tensor:
        """The kernel's layout -> (in, out), in the packed dtype (a copy where it must be)."""
        ...

    def matmul(self, x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
        """x (M, in) @ W (+ bias) -> (M, out): float32 on the approximate path, else x's dtype."""
        ...


class AttendRows(Protocol):
    """Attention of listed rows over listed cache slots, straight from a paged or static cache,
    rotary applied to the new rows inside (the CPU kernel's contract: see `cpu_isa.RowOps`), for
    queries of `head_dims` and `dtypes` on a device of `device_type`."""

    head_dims: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    device_type: str

    def __call__(
        self,
        q: Tensor,  # (H, T, D)
        k: Tensor,  # (H_kv, T, D) the new keys
        v: Tensor,  # (H_kv, T, D) the new values
        cache_k: Tensor,  # (H_kv, S, D) the layer's key slots
        cache_v: Tensor,  # (H_kv, S, D)
        rows: Tensor,  # (R,) long: which of the T rows to compute
        new_slots: Tensor,  # (R,) long: the slot each row's key/value is stored at
        row_ptr: Tensor,  # (R+1,) long: CSR offsets into `idx`
        idx: Tensor,  # (nnz,) long: the slots each row sees
        out: Tensor,  # (T, H, D): rows `rows` are written
        cos: Tensor,  # (T, D)
        sin: Tensor,  # (T, D)
    ) -> None: ...


@dataclass(frozen=True)
class LayerWeights:
    """One pre-norm decoder layer as `DecoderRows` takes it: the norms' weights (C,) and epsilon,
    each matrix as the quantized kernel holds it with its bias (or None), and the heads."""

    attn_norm: Tensor | None  # None: no norm before attention (EAGLE's draft layer)
    mlp_norm: Tensor
    eps: float
    qkv: QuantWeight
    qkv_bias: Tensor | None
    o: QuantWeight
    o_bias: Tensor | None
    gate_up: QuantWeight
    gate_up_bias: Tensor | None
    down: QuantWeight
    down_bias: Tensor | None
    heads: int
    kv_heads: int
    head_dim: int


class DecoderRows(Protocol):
    """A whole decoding forward's layers in one call (norm, q|k|v, row attention with rotary, o,
    residual, norm, gate|up, SiLU, down, residual), with the very kernels the layers call one by
    one, in the same order: the same bits, without the calls between them."""

    def prepare(self, layers: Sequence[LayerWeights]) -> object | None:
        """What `run` takes for these layers (laid out once, when the model binds its kernels), or
        None where some layer is not one it computes."""
        ...

    def run(
        self,
        prepared: object,
        x: Tensor,  # (T, C) float32, updated in place
        caches: Sequence[tuple[Tensor, Tensor]],  # each layer's (H_kv, S, D) key and value slots
        rows: Tensor,  # (T,) long: every row goes through the row attention
        new_slots: Tensor,  # (T,) long
        row_ptr: Tensor,  # (T+1,) long
        idx: Tensor,  # (nnz,) long
        cos: Tensor,  # (T, D)
        sin: Tensor,  # (T, D)
        prefill_from: int,  # rows from here on are a prompt's (`QuantKernel.matmul`)
    ) -> None: ...

    def approximate(self) -> DecoderRows:
        """This decoder with its rows computed as `QuantKernel.approximate`'s (a draft's)."""
        ...


class Probe(Protocol):
    """The best a kernel set does on this machine with `threads` threads."""

    def peak_flops(self, threads: int) -> float:
        """FLOP/s of its fused multiply-adds with nothing else to wait for."""
        ...

    def read_bandwidth(self, threads: int) -> float:
        """Bytes/s of reading memory far larger than the caches, as its products read weights."""
        ...

    def peak_int8_ops(self, threads: int) -> float | None:
        """Integer ops/s (two a multiply-add) of its int8 dot products alone, the compute bound
        of int8 activations; None where it has none."""
        ...


@dataclass(frozen=True)
class Kernels:
    """The kernels of one model, chosen once at load time (`specdecode.kernels.select`).

    - `linears`: candidates for a layer's weight, tried in order (the first that accepts it packs
      it); the last accepts anything.
    - `approx`: candidates for the approximate product of drafts and of the greedy screen (inputs
      and weights rounded to bfloat16), packed from a float32 (in, out) weight; the last accepts
      any.
    - `rms_norm(x, weight, eps)`: `reference.rms_norm`'s result, in any dtype.
    - `silu_mul(gate_up)`: (..., 2 I) -> SiLU(gate) * up (..., I), the SwiGLU MLP's middle.
    - `decoder`: a whole decoding forward's layers in one call, or None (see `DecoderRows`).
    - `head`: the product of the LM head's float (C, V) weight as it is kept, or None for
      `x @ W` (the GPU's pads its rows, as its linears do: see `kernels.cuda`).
    - `attend_rows`: the row-attention kernel, or None: then SDPA runs every segment.
    - `fast_bf16`: bfloat16 weights run faster than float32 ones here (what an "auto" draft
      model's dtype follows).
    - `quant`: products with weights kept in GGUF block formats, or None (then a GGUF's weights
      are dequantized when the model loads).
    - `probe`: what these kernels reach at best on this machine (the bounds benchmarks draw), or
      None where that is not measured.
    """

    name: str
    linears: tuple[LinearKernel, ...]
    approx: tuple[LinearKernel, ...]
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    silu_mul: Callable[[Tensor], Tensor]
    attend_rows: AttendRows | None = None
    fast_bf16: bool = False
    quant: QuantKernel | None = None
    probe: Probe | None = None
    decoder: DecoderRows | None = None
    head: LinearKernel | None = None

    def linear_for(self, weight_t: Tensor) -> LinearKernel:
        """The first linear kernel that takes this (in, out) weight."""
        return next(k for k in self.linears if k.accepts(weight_t))

    def approx_for(self, weight_t: Tensor) -> LinearKernel:
        """The first approximate kernel that takes this (in, out) weight."""
        return next(k for k in self.approx if k.accepts(weight_t))

    def int8_activations(self) -> Kernels:
        """These kernels with the quantized products' activations rounded to int8 where that is
        faster (`QuantKernel.approximate`: prompt rows, and decoding rows of Q4_0, Q4_1, Q4_K, Q6_K, Q8_0):
        what a draft model runs on (a draft only proposes; the target's verification keeps output
        exact), and a target where asked (`activations="int8"`, as llama.cpp computes: its own
        plain and speculative decoding still agree, each row's result the same in any batch)."""
        if self.quant is None:
            return self
        decoder = None if self.decoder is None else self.decoder.approximate()
        return replace(self, name=f"{self.name}-int8", quant=self.quant.approximate(), decoder=decoder)

    def attends(self, q: Tensor) -> bool:
        """Whether `attend_rows` takes these queries (B, H, T, D): one sequence row of a dtype it
        computes on its device, a head size it was built for, no gradients wanted."""
        return (
            self.attend_rows is not None
            and q.dtype in self.attend_rows.dtypes
            and q.device.type == self.attend_rows.device_type
            and q.shape[0] == 1
            and q.shape[-1] in self.attend_rows.head_dims
            and not (torch.is_grad_enabled() and q.requires_grad)
        )


# ---- weights kept in GGUF's block formats ----------------------------------------------------------

QUANT_FORMATS = {  # name: (ggml type id, weights per block, bytes per block)
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q5_0": (6, 32, 22),
    "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144),
    "Q6_K": (14, 256, 210),
}


GGUF_LAYOUT = "gguf"  # blocks as a GGUF file stores them: one row of blocks per output
# A CPU layout whose name has one of these parts holds the quants of its formats in words
# (quant_gemm.cpp's `put4`, `put6`), and its kernel calls name them with WORDS added to the ggml
# type id.
WORDS = 256
WORD_LAYOUTS = {"-words4": frozenset({"Q4_0", "Q4_1", "Q4_K"}), "-words6": frozenset({"Q6_K"})}


@dataclass(frozen=True)
class QuantPart:
    """`rows` output rows of a weight, each its input weights in the blocks of `format` (one of
    QUANT_FORMATS): in `data` (uint8) as a GGUF file stores them ((rows, row_bytes), the layout
    "gguf"), or laid out again by a kernel's `pack` (the layout it names) with the same quants and
    scales. `rows` may be left out for the GGUF layout."""

    format: str
    data: Tensor
    layout: str = GGUF_LAYOUT
    rows: int = -1

    def __post_init__(self) -> None:
        if self.rows < 0:
            if self.layout != GGUF_LAYOUT:
                raise ValueError(f"a {self.layout} part needs its number of rows")
            object.__setattr__(self, "rows", int(self.data.shape[0]))


@functools.cache
def kernel_format(fmt: str, layout: str) -> int:
    """The format id a kernel call takes for quants of `fmt` laid out as `layout`: its ggml type
    id, plus WORDS where the layout holds them in words (worked out once per pair: embedding rows
    ask every step)."""
    words = any(fmt in formats and name in layout for name, formats in WORD_LAYOUTS.items())
    return QUANT_FORMATS[fmt][0] | (WORDS if words else 0)


@dataclass(frozen=True)
class QuantWeight:
    """A linear weight (in_features -> the parts' rows, stacked) kept as stored. A fused matrix
    (q|k|v) may have parts in different formats, as a GGUF's tensors may; all in one layout."""

    in_features: int
    parts: tuple[QuantPart, ...]

    @property
    def layout(self) -> str:
        return self.parts[0].layout

    @functools.cached_property
    def out_features(self) -> int:
        return sum(p.rows for p in self.parts)

    @functools.cached_property
    def calls(self) -> tuple[tuple[int, int, int, int], ...]:
        """Per part: (format id (`kernel_format`), data address, rows, first output column), what
        a kernel call takes; worked out once (a decoding step makes ~120 products)."""
        firsts = [0]
        for p in self.parts:
            firsts.append(firsts[-1] + p.rows)
        return tuple(
            (kernel_format(p.format, p.layout), p.data.data_ptr(), p.rows, first)
            for p, first in zip(self.parts, firsts, strict=False)
        )

    @property
    def nbytes(self) -> int:
        return sum(p.data.numel() for p in self.parts)


class QuantKernel(Protocol):
    """Products with weights kept in GGUF block formats: float32 activations and sums, each block
    dequantized in registers to exactly the values gguf-py's dequantization gives. A weight is
    laid out once in the kernel's `layout` (`pack`, when a model is loaded); every other method
    takes it that way."""

    name: str
    layout: str
    formats: frozenset[str]

    def pack(self, weight: QuantWeight) -> QuantWeight:
        """A weight in the GGUF layout, or in a layout `repacks` names -> the same quants and
        scales in the kernel's layout."""
        ...

    def repacks(self, layout: str) -> bool:
        """Whether `pack` takes weights laid out as `layout` (the GGUF's, or another of the same
        build's layouts: its float and int8 rows may read the 4-bit quants laid out differently)."""
        ...

    def matmul(
        self, x: Tensor, weight: QuantWeight, bias: Tensor | None = None, prefill: bool = False
    ) -> Tensor:
        """x (M, in) float32 -> (M, out) float32. Rows of a decoding step (the default) get the
        same result in any batch; `prefill` rows (a prompt's) may be computed another way, the
        fastest for many rows (each row's result still independent of the others)."""
        ...

    def rows(self, weight: QuantWeight, ids: Tensor) -> Tensor:
        """Output rows `ids` (n,) of the weight, dequantized: (n, in) float32 (embedding lookup)."""
        ...

    def dequantize(self, weight: QuantWeight) -> Tensor:
        """The whole weight dequantized, (in, out) float32."""
        ...

    def first_outputs(self, weight: QuantWeight, n: int) -> QuantWeight | None:
        """The weight's first `n` outputs as a weight of their own sharing its memory (its
        products are the first n columns of the whole one's, bit for bit), or None where the
        layout cannot cut there."""
        ...

    def approximate(self) -> QuantKernel:
        """A kernel for a draft model (its layout may differ: `repacks` takes this one's), whose
        rows may be computed with less precision, faster (`prefill` rows, and decoding rows where
        its format allows; a draft's decoding rows stay the same alone or in any batch); itself
        where it has no such way."""
        ...
