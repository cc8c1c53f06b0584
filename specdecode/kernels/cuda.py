"""The kernels of a model on an NVIDIA GPU: PyTorch's own ops (cuBLAS products, fused attention),
exact in the model's dtype, with a probe of what the card reaches (the bounds the benchmarks
draw). Launch overhead, what bounds a small model there, is the engine's to remove: it replays
decoding steps from captured CUDA graphs (`engine.graphs`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from specdecode.kernels.reference import EXACT


class CudaProbe:
    """Copy bandwidth and bfloat16 matrix-product rate of the current GPU, measured once each."""

    def read_bandwidth(self, threads: int) -> float:
        """Bytes/s of a device-to-device copy of 1 GiB, counting bytes read and written (a
        weight-bound forward reads as fast as a copy moves both)."""
        return _copy_rate()

    def peak_flops(self, threads: int) -> float:
        """FLOP/s of a 8192^3 bfloat16 product on random data."""
        return _matmul_rate()


def _timed(fn: Callable[[], object], repeats: int = 10) -> float:
    """Median seconds of `fn()` on the GPU, by CUDA events, after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return sorted(times)[len(times) // 2]


@functools.cache
def _copy_rate() -> float:
    src = torch.randn(1 << 28, device="cuda")  # 1 GiB of float32
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / _timed(lambda: dst.copy_(src))


@functools.cache
def _matmul_rate() -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / _timed(lambda: a @ b)


CUDA = dataclasses.replace(EXACT, name="torch-cuda", probe=CudaProbe())
