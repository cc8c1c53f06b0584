"""Our kernels built once per instruction set: the quantized products (`quant_gemm.cpp`, wrapped
by `quant.py`), row attention and RMS norm (`row_ops.cpp`), the products of float weights in
32-column tiles (`tiles.cpp`; `tiles.py` lays them out), all computing in the 16 float lanes of
`lanes.h`, and the probe of their peak multiply-add rate (`probe.cpp`, for benchmarks' bounds).

Each source is built for AVX-512, for AVX2 + FMA + F16C, and portably (plain loops the compiler
vectorizes for its target: SSE2 on x86, NEON on ARM); `SPECDECODE_CPU_ISA` forces one, else the
best this CPU runs is used (`build.best_isa`). The library is compiled on first use into the cache
directory and called through ctypes, by this module and `quant.py` alone.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor

from specdecode.kernels import build, tiles
from specdecode.kernels.base import QUANT_FORMATS, LayerWeights
from specdecode.kernels.reference import apply_rotary
from specdecode.kernels.reference import rms_norm as torch_rms_norm
from specdecode.kernels.reference import silu_mul as torch_silu_mul

_HERE = Path(__file__).parent
_SOURCES = tuple(
    _HERE / f for f in ("quant_gemm.cpp", "row_ops.cpp", "decoder.cpp", "probe.cpp", "tiles.cpp")
)
_BUILDS = {  # compiler flags of each instruction set's build
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "generic": (),
}
# Used where the CPU has them: AVX512-VNNI's int8 dot products (int8 rows: `quant.py`), AVX512-VBMI's
# byte permutes and multishifts (Q6_K's and Q8_0's int8 decoding rows), and for the AVX2 build
# AVX-VNNI's 256-bit dot products (CPUs without AVX-512: Intel's client chips, AMD's Zen 5).
_OPTIONAL = {
    "avx512": (("avx512_vnni", "-mavx512vnni"), ("avx512vbmi", "-mavx512vbmi")),
    "avx2": (("avx_vnni", "-mavxvnni"),),
}
HEAD_DIMS = (16, 32, 64, 128)  # head sizes the row attention is built for
# quant_gemm.cpp's arithmetic of a product's rows: a decoding step's (each row's result the same in
# any batch), a prompt's (float32 activations), a draft's prompt (int8 activations), a draft's
# decoding step (int8 activations for Q4_0, Q4_1, Q4_K, Q6_K and Q8_0 on AVX-512 and AVX2)
DECODING, EXACT_PREFILL, INT8_PREFILL, INT8_DECODING = 0, 1, 2, 3
UNIT = 32  # outputs of one unit of quant_gemm.cpp's layouts (32 outputs interleaved block by block)


def layout(lib: ctypes.CDLL, int8: bool = False) -> str:
    """The name of a build's layout of stored weights for float32 activations, or with `int8` for
    int8 ones (quant_gemm.cpp's `specdecode_qlayout`, `specdecode_qlayout_int8`: the 4-bit quants
    in words on AVX-512, and on AVX2 for int8 rows; in GGUF's byte pairs elsewhere)."""
    return (lib.specdecode_qlayout_int8 if int8 else lib.specdecode_qlayout)().decode()


@functools.cache
def library(isa: str, optional: bool = True) -> ctypes.CDLL | None:
    """The `isa` build of the kernels, or None where it cannot be had (no compiler, or the CPU
    cannot run it). `optional` False leaves out the extensions it would use where the CPU has
    them (tests: the paths of CPUs without them); a compiler that cannot build them gets the build
    without them."""
    if not build.isa_runs_here(isa):
        return None
    extras = _OPTIONAL.get(isa, ()) if optional else ()
    optional_flags = [flag for cpu_flag, flag in extras if cpu_flag in build.cpu_flags()]
    flags = ("-std=c++20", "-ffp-contract=fast", *_BUILDS[isa])
    lib = build.load(f"cpu-{isa}", _SOURCES, (*flags, *optional_flags))
    if lib is None and optional_flags:  # a compiler without an extension's flag (-mavxvnni: GCC 11)
        lib = build.load(f"cpu-{isa}", _SOURCES, flags)
    if lib is None:
        return None
    p, i, f, n = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    for name in ("specdecode_qlayout", "specdecode_qlayout_int8"):
        getattr(lib, name).argtypes = []
        getattr(lib, name).restype = ctypes.c_char_p
    lib.specdecode_qrelayout.argtypes = [n, p, i, i, p]
    lib.specdecode_qrelayout.restype = n
    lib.specdecode_qpacked_bytes.argtypes = [n, i, i]
    lib.specdecode_qpacked_bytes.restype = i
    lib.specdecode_qpack.argtypes = [n, p, i, i, p]
    lib.specdecode_qpack.restype = n
    lib.specdecode_qmm.argtypes = [n, p, i, i, p, i, p, i, n, n]
    lib.specdecode_qmm.restype = n
    lib.specdecode_qrows.argtypes = [n, p, i, p, i, p]
    lib.specdecode_qrows.restype = n
    # q, k, v (pointer, head stride, row stride); caches, head stride; rows, slots, count; CSR;
    # out, row stride; H, H_kv, D; scale; cos, sin; threads; whether the cache is float16
    lib.specdecode_attend_rows.argtypes = [p, i, i] * 3 + [p, p, i, p, p, i, p, p, p, i, i, i, i, f, p, p, n]
    lib.specdecode_attend_rows.argtypes += [n]
    lib.specdecode_attend_rows.restype = n
    lib.specdecode_rms_norm.argtypes = [p, p, p, i, i, f]
    lib.specdecode_rms_norm.restype = None
    lib.specdecode_silu_mul.argtypes = [p, i, i, p]
    lib.specdecode_silu_mul.restype = None
    # records, layers; x, T, C, H, Hkv, D, I, eps; caches, head stride; rows, slots, count, CSR;
    # cos, sin, scale; prefill_from, decoding and prefill arithmetic, threads, whether the cache
    # is float16
    lib.specdecode_decoder_rows.argtypes = [
        *(p, n, p, i, i, i, i, i, i, f, p, i, p, p, i, p, p, p, p, f),
        *(i, n, n, n, n),
    ]
    lib.specdecode_decoder_rows.restype = n
    lib.specdecode_tiles_f32.argtypes = [p, p, p, i, i, i, n]
    lib.specdecode_tiles_f32.restype = n
    if hasattr(lib, "specdecode_tiles_bf16"):  # the AVX-512 build, where the compiler has AVX512_BF16
        lib.specdecode_tiles_bf16.argtypes = [p, p, p, i, i, i, n]
        lib.specdecode_tiles_bf16.restype = n
    lib.specdecode_peak_flops.argtypes = [n, i]
    lib.specdecode_peak_flops.restype = ctypes.c_double
    lib.specdecode_read_bandwidth.argtypes = [n, i]
    lib.specdecode_read_bandwidth.restype = ctypes.c_double
    lib.specdecode_peak_int8_ops.argtypes = [n, i]
    lib.specdecode_peak_int8_ops.restype = ctypes.c_double
    lib.specdecode_attention_prefetch.argtypes = [n]
    lib.specdecode_attention_prefetch.restype = None
    lib.specdecode_attention_prefetch(int(attention_prefetch(RowOps(isa, lib))))
    lib.specdecode_pair_tiles.argtypes = [n]
    lib.specdecode_pair_tiles.restype = None
    if isa == "avx512":  # the one build whose few rows can pair tiles
        lib.specdecode_pair_tiles(int(tile_pairing(lib)))
    return lib


def faster_on(seconds: Callable[[bool], float], ties: bool) -> bool:
    """Whether a kernel's switch is faster on than off: `seconds(on)` run once untimed (the data's
    pages touched), then alternately five times each; the lower median wins (`ties` on a tie)."""
    seconds(True)
    runs: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(5):
        for on in (True, False):
            runs[on].append(seconds(on))
    on, off = statistics.median(runs[True]), statistics.median(runs[False])
    return on < off or (on == off and ties)


def attention_prefetch(ops: RowOps) -> bool:
    """Whether row attention should ask for keys and values ahead in software on this machine
    (row_ops.cpp's `ask_for`): `SPECDECODE_ATTENTION_PREFETCH` (0 or 1) where set, else timed
    both ways: one row over 2048 slots of 16 layers' caches (50 MB: from memory, not a cache),
    alternately, five times each; the faster median wins (the same bits either way)."""
    forced = os.environ.get("SPECDECODE_ATTENTION_PREFETCH")
    if forced in ("0", "1"):
        return forced == "1"
    layers, heads, kv_heads, d, slots = 16, 9, 3, 64, 2048
    caches = torch.zeros(layers, 2, kv_heads, slots + 1, d)  # zeros: every score alike, as fast as any
    q, new = torch.zeros(heads, 1, d), torch.zeros(kv_heads, 1, d)
    rows, new_slot = torch.zeros(1, dtype=torch.int64), torch.full((1,), slots, dtype=torch.int64)
    row_ptr, idx = torch.tensor([0, slots + 1]), torch.arange(slots + 1)
    out = torch.empty(1, heads, d)

    def seconds(on: bool) -> float:
        ops._lib.specdecode_attention_prefetch(int(on))
        start = time.perf_counter()
        for k, v in caches:
            ops(q, new, new, k, v, rows, new_slot, row_ptr, idx, out)
        return time.perf_counter() - start

    return faster_on(seconds, ties=True)


def tile_pairing(lib: ctypes.CDLL) -> bool:
    """Whether the AVX-512 build's few-row products should pair a unit's two tiles up to 6 rows
    (quant_gemm.cpp's `pair_tiles`, as chosen on a Zen 5) rather than go a tile a pass (8-25%
    faster at 1-32 rows on a Zen 4, whose AVX-512 runs as two halves): `SPECDECODE_PAIR_TILES`
    (0 or 1) where set, else timed both ways: random Q4_K products of 2 and 4 rows over four
    copies of a 4096 x 1536 matrix (14 MB), alternately, five times each; the faster median wins
    (the same bits either way)."""
    forced = os.environ.get("SPECDECODE_PAIR_TILES")
    if forced in ("0", "1"):
        return forced == "1"
    fmt, per, size = QUANT_FORMATS["Q4_K"]
    rows, k = 4096, 1536
    blocks = torch.randint(
        0, 256, (rows, k // per, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    blocks[:, :, 0:4] = torch.tensor([0x00, 0x1C, 0x00, 0x1C], dtype=torch.uint8)  # d = dmin = 2^-8 (fp16)
    src = blocks.reshape(rows, -1).contiguous()
    copies = [torch.empty(lib.specdecode_qpacked_bytes(fmt, rows, k), dtype=torch.uint8) for _ in range(4)]
    for packed in copies:
        lib.specdecode_qpack(fmt, src.data_ptr(), rows, k, packed.data_ptr())
    xs = [torch.randn(m, k, generator=torch.Generator().manual_seed(m)) for m in (2, 4)]  # (M, K)
    y = torch.empty(4, rows)
    threads = torch.get_num_threads()

    def seconds(on: bool) -> float:
        lib.specdecode_pair_tiles(int(on))
        start = time.perf_counter()
        for x in xs:
            for packed in copies:
                m = x.shape[0]
                lib.specdecode_qmm(
                    fmt, x.data_ptr(), m, k, packed.data_ptr(), rows, y.data_ptr(), rows, threads, DECODING
                )
        return time.perf_counter() - start

    return faster_on(seconds, ties=False)


class Probe:
    """The `Probe` of one instruction set's build (`probe.cpp`): best of three runs each."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib

    def peak_flops(self, threads: int) -> float:
        return max(self._lib.specdecode_peak_flops(threads, 2_000_000) for _ in range(3))

    def read_bandwidth(self, threads: int) -> float:
        return float(self._lib.specdecode_read_bandwidth(threads, 512 * 2**20))

    def peak_int8_ops(self, threads: int) -> float | None:
        ops = max(self._lib.specdecode_peak_int8_ops(threads, 1_000_000) for _ in range(3))
        return ops or None  # the portable build multiplies no int8


class FloatTiles:
    """x (M, K) @ W for float32 W in 32-column tiles (`tiles.tile_weight`), on one instruction
    set's build (`tiles.cpp`): each output a running sum over k in order, so a row's result does
    not depend on the other rows, and is the same on every build with fused multiply-add."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib

    def __call__(self, x: Tensor, tiled: Tensor) -> Tensor:  # (M, K) @ (N/32, K, 32) -> (M, N)
        t, k, w = tiled.shape
        x = x.contiguous()
        y = torch.empty(x.shape[0], t * w)
        done = self._lib.specdecode_tiles_f32(
            x.data_ptr(), tiled.data_ptr(), y.data_ptr(), x.shape[0], k, t * w, torch.get_num_threads()
        )
        if done != 0:
            raise ValueError(f"float tiles: unsupported shape (M={x.shape[0]}, K={k}, N={t * w})")
        return y


def float_tiles(isa: str) -> FloatTiles | None:
    lib = library(isa)
    return None if lib is None else FloatTiles(lib)


class BF16Tiles:
    """Approximately x (M, K) @ W for W in the bf16 kernel's tiles (`tiles.tile_weight_bf16`):
    x rounded to bfloat16, products summed in float32 (AVX512_BF16), each row on its own."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib

    def __call__(self, x: Tensor, tiled: Tensor) -> Tensor:  # (M, K) @ (N/32, K/2, 32, 2) -> (M, N)
        t, k2, w, _ = tiled.shape
        xb = x.to(torch.bfloat16).contiguous()
        y = torch.empty(x.shape[0], t * w)
        threads = torch.get_num_threads()
        for s in range(0, x.shape[0], tiles.BF16_CALL_ROWS):
            part, out = xb[s : s + tiles.BF16_CALL_ROWS], y[s : s + tiles.BF16_CALL_ROWS]
            if self._lib.specdecode_tiles_bf16(
                part.data_ptr(), tiled.data_ptr(), out.data_ptr(), part.shape[0], 2 * k2, t * w, threads
            ):
                raise ValueError(f"bf16 tiles: unsupported shape (K={2 * k2}, N={t * w})")
        return y


def bf16_tiles() -> BF16Tiles | None:
    """The bf16 tiles of the AVX-512 build, where the CPU has AVX512_BF16 and no lower set is
    forced (`SPECDECODE_CPU_ISA`)."""
    if "avx512_bf16" not in build.cpu_flags() or build.forced_isa() not in (None, "avx512"):
        return None
    lib = library("avx512")
    return None if lib is None or not hasattr(lib, "specdecode_tiles_bf16") else BF16Tiles(lib)


def probe(isa: str) -> Probe | None:
    lib = library(isa)
    return None if lib is None else Probe(lib)


# decoder.cpp's layer record: two norms, then four matrices of (bias, parts, 3 x (type, data, rows))
MAX_PARTS, MATRIX = 3, 2 + 3 * 3
RECORD = 2 + 4 * MATRIX


@dataclass(frozen=True)
class Prepared:
    """Layers laid out for `decoder.cpp`: the records (L, RECORD) int64 and the shapes."""

    records: Tensor
    layers: tuple[LayerWeights, ...]  # keeps what the records point at alive
    c: int
    heads: int
    kv_heads: int
    head_dim: int
    width: int  # the MLP's
    eps: float


def cache_is_half(cache: Tensor) -> int:
    """1 for a float16 key/value cache (the kernels widen it as they read and round what they
    store), 0 for float32; float32 rows take no other."""
    if cache.dtype not in (torch.float32, torch.float16):
        raise ValueError(f"the row kernels read float32 or float16 caches, not {cache.dtype}")
    return int(cache.dtype == torch.float16)


class Decoder:
    """`DecoderRows` of one instruction set's build (`decoder.cpp`); decoding rows take the
    arithmetic `decoding`, prompt rows `prefill` (as `quant.QuantCPU`'s)."""

    def __init__(
        self, lib: ctypes.CDLL, quant_layout: str, decoding: int = DECODING, prefill: int = EXACT_PREFILL
    ) -> None:
        self._lib, self._layout, self.decoding, self.prefill = lib, quant_layout, decoding, prefill

    def approximate(self) -> Decoder:
        """This decoder with a draft's rows read in int8 (`QuantCPU.approximate`)."""
        return Decoder(self._lib, layout(self._lib, int8=True), INT8_DECODING, INT8_PREFILL)

    def prepare(self, layers: Sequence[LayerWeights]) -> Prepared | None:
        if not layers:
            return None
        first = layers[0]
        shape = (first.heads, first.kv_heads, first.head_dim, first.eps)
        if first.head_dim not in HEAD_DIMS:
            return None
        records = torch.zeros(len(layers), RECORD, dtype=torch.int64)
        for i, layer in enumerate(layers):
            if (layer.heads, layer.kv_heads, layer.head_dim, layer.eps) != shape:
                return None
            row = [0 if layer.attn_norm is None else layer.attn_norm.data_ptr(), layer.mlp_norm.data_ptr()]
            for weight, bias in (
                (layer.qkv, layer.qkv_bias), (layer.o, layer.o_bias),
                (layer.gate_up, layer.gate_up_bias), (layer.down, layer.down_bias),
            ):  # fmt: skip
                if weight.layout != self._layout or len(weight.parts) > MAX_PARTS:
                    return None
                calls = [v for fmt, data, rows, _ in weight.calls for v in (fmt, data, rows)]
                row += [0 if bias is None else bias.data_ptr(), len(weight.parts), *calls]
                row += [0] * (3 * (MAX_PARTS - len(weight.parts)))
            records[i] = torch.tensor(row, dtype=torch.int64)
        c, width = first.mlp_norm.numel(), first.down.in_features
        return Prepared(records, tuple(layers), c, *shape[:3], width, shape[3])

    def run(  # shapes: `base.DecoderRows`
        self, prepared: object, x: Tensor, caches: Sequence[tuple[Tensor, Tensor]], rows: Tensor,
        new_slots: Tensor, row_ptr: Tensor, idx: Tensor, cos: Tensor, sin: Tensor, prefill_from: int,
    ) -> None:  # fmt: skip
        assert isinstance(prepared, Prepared) and x.is_contiguous() and x.dtype == torch.float32
        p = prepared
        stride = caches[0][0].stride(0)
        assert all(k.stride(0) == v.stride(0) == stride for k, v in caches)
        half = cache_is_half(caches[0][0])
        pointers = torch.tensor([t.data_ptr() for pair in caches for t in pair], dtype=torch.int64)
        cos, sin = cos.contiguous(), sin.contiguous()
        done = self._lib.specdecode_decoder_rows(
            p.records.data_ptr(), p.records.shape[0], x.data_ptr(), x.shape[0], p.c, p.heads, p.kv_heads,
            p.head_dim, p.width, p.eps, pointers.data_ptr(), stride, rows.data_ptr(), new_slots.data_ptr(),
            rows.shape[0], row_ptr.data_ptr(), idx.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            1.0 / math.sqrt(p.head_dim), prefill_from, self.decoding, self.prefill, torch.get_num_threads(),
            half,
        )  # fmt: skip
        if done != 0:
            raise ValueError(f"decoder kernel: cannot run these layers (code {done})")


def decoder_rows(isa: str) -> Decoder | None:
    lib = library(isa)
    return None if lib is None else Decoder(lib, layout(lib))


class RowOps:
    """Row attention (the `AttendRows` interface) and RMS norm of one instruction set's build."""

    head_dims: ClassVar[tuple[int, ...]] = HEAD_DIMS
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16, torch.float16)
    device_type: ClassVar[str] = "cpu"

    def __init__(self, isa: str, lib: ctypes.CDLL) -> None:
        self.isa, self._lib = isa, lib

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        """(..., 2 I) -> SiLU(first half) * second half (..., I): one call instead of torch's four
        ops for float32 on CPU without gradients; torch's otherwise (the same up to rounding)."""
        if gate_up.dtype is not torch.float32 or not gate_up.is_cpu or gate_up.requires_grad:
            return torch_silu_mul(gate_up)
        gu = gate_up.contiguous()
        width = gu.shape[-1] // 2
        out = torch.empty(*gu.shape[:-1], width)
        self._lib.specdecode_silu_mul(gu.data_ptr(), gu.numel() // (2 * width), width, out.data_ptr())
        return out

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """x (..., C) -> RMS-normalised and scaled by `weight` (C,): one call instead of torch's
        six ops (~40 us) for float32 on CPU without gradients; torch's otherwise."""
        if (
            x.dtype is not torch.float32
            or not x.is_cpu
            or weight.dtype is not torch.float32
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        ):
            return torch_rms_norm(x, weight, eps)
        x = x.contiguous()
        y = torch.empty_like(x)
        c = x.shape[-1]
        self._lib.specdecode_rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // c, c, eps)
        return y

    def __call__(  # shapes: `base.AttendRows`; q, k, v may have any strides with a unit last one
        self, q: Tensor, k: Tensor, v: Tensor, cache_k: Tensor, cache_v: Tensor, rows: Tensor,
        new_slots: Tensor, row_ptr: Tensor, idx: Tensor, out: Tensor, cos: Tensor | None = None,
        sin: Tensor | None = None,
    ) -> None:  # fmt: skip
        """Store the rows' new keys/values in the cache, then softmax(q k^T / sqrt(D)) v over each
        row's slots into `out`. With `cos`/`sin`, q and the new keys are rotated first (bitwise as
        `reference.apply_rotary` does). D must be one of HEAD_DIMS. Rows in bfloat16 or float16
        are widened to float32 for the kernel (`_attend_widened`)."""
        if q.dtype is not torch.float32:
            assert cos is not None and sin is not None
            self._attend_widened(q, k, v, cache_k, cache_v, rows, new_slots, row_ptr, idx, out, cos, sin)
            return
        h, _, d = q.shape
        hkv = k.shape[0]
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        assert cache_k.stride() == cache_v.stride() and cache_k.stride(1) == d
        assert cache_k.dtype == cache_v.dtype
        done = self._lib.specdecode_attend_rows(
            q.data_ptr(), q.stride(0), q.stride(1),
            k.data_ptr(), k.stride(0), k.stride(1),
            v.data_ptr(), v.stride(0), v.stride(1),
            cache_k.data_ptr(), cache_v.data_ptr(), cache_k.stride(0),
            rows.data_ptr(), new_slots.data_ptr(), rows.shape[0], row_ptr.data_ptr(), idx.data_ptr(),
            out.data_ptr(), out.stride(0), h, hkv, d, 1.0 / math.sqrt(d),
            None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(),
            torch.get_num_threads(), cache_is_half(cache_k),
        )  # fmt: skip
        if done != 0:
            raise ValueError(f"attention kernel: unsupported shape (H={h}, H_kv={hkv}, D={d})")

    def _attend_widened(  # shapes: `base.AttendRows`, in bfloat16 or float16
        self, q: Tensor, k: Tensor, v: Tensor, cache_k: Tensor, cache_v: Tensor, rows: Tensor,
        new_slots: Tensor, row_ptr: Tensor, idx: Tensor, out: Tensor, cos: Tensor, sin: Tensor,
    ) -> None:  # fmt: skip
        """Rows in half precision: their queries and new keys rotated in their dtype (as
        `reference.apply_rotary` does for a prompt's rows), the new keys and values stored, then
        the float32 kernel over the slots the rows read, widened into a compact copy (the rows'
        slot lists renumbered in the same order): a row's result depends on its own slots alone,
        as it does in float32 (SDPA over a step's rows rounds a row by the step's shape)."""
        c, s = cos[rows], sin[rows]  # (R, D)
        keys = apply_rotary(k[:, rows], c, s)  # (H_kv, R, D)
        cache_k[:, new_slots] = keys.to(cache_k.dtype)
        cache_v[:, new_slots] = v[:, rows].to(cache_v.dtype)
        seen, local = torch.unique(idx, return_inverse=True)  # (U,) sorted slots; idx renumbered
        wide_k, wide_v = cache_k[:, seen].float(), cache_v[:, seen].float()  # (H_kv, U, D)
        queries = apply_rotary(q[:, rows], c, s).float()  # (H, R, D)
        r = rows.shape[0]
        res = torch.empty(r, q.shape[0], q.shape[2])  # (R, H, D) float32
        here = torch.arange(r)
        own = torch.searchsorted(seen, new_slots)  # the new rows' places in the copy
        self(queries, keys.float(), v[:, rows].float(), wide_k, wide_v, here, own, row_ptr, local, res)
        out[rows] = res.to(out.dtype)


def row_ops(isa: str) -> RowOps | None:
    lib = library(isa)
    return None if lib is None else RowOps(isa, lib)
