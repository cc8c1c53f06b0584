"""Typed settings of the serving engine, validated in one place."""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.errors import SpecDecodeError
from specdecode.spec_config import SpecConfig, parse_speculative

KV_CACHE_DTYPES = ("auto", "float32", "float16")


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecDecodeError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """How the serving engine batches, caches and speculates.

    `kv_cache_memory`: bytes for the target's KV blocks; None = `kv_cache_fraction` of the memory
    available now (RAM on CPU, free GPU memory on CUDA), never more than the blocks
    `max_num_seqs` full-context requests could use. `max_batch_tokens`: tokens per target forward
    (decode roots, drafts, side tokens and prefill chunks together). `policy`: let the load policy
    choose each step how many draft tokens each request may verify (see `serving.policy`).
    `latency_curve`: the policy's forward-latency curve as (tokens, seconds) points; None =
    measured on this model when the engine starts. `prefix_caching`: reuse full KV blocks across
    requests sharing a token prefix. `speculative`: the method for requests that do not say.
    `cuda_graphs`: on a GPU, replay decoding and verification forwards from captured CUDA graphs
    (`engine.graphs`); off, every forward launches its kernels one by one. `kv_cache_dtype`: what
    the target's keys and values are kept in: "auto" (the model's dtype), "float32" or "float16"
    (half the bytes to read at each step and to hold, as llama.cpp's default f16 cache; attention
    still computes in the model's dtype, on keys and values rounded to float16 once when stored).
    """

    block_size: int = 16
    kv_cache_memory: int | None = None
    max_num_seqs: int = 64
    max_batch_tokens: int = 512
    policy: bool = True
    speculative: SpecConfig | None = None
    kv_cache_fraction: float = 0.25
    latency_curve: tuple[tuple[int, float], ...] | None = None
    prefix_caching: bool = True
    cuda_graphs: bool = True
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_batch_tokens", self.max_batch_tokens)
        if self.kv_cache_memory is not None:
            _positive("kv_cache_memory", self.kv_cache_memory)
        fraction = self.kv_cache_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction <= 1:
            raise SpecDecodeError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction!r}")
        for name in ("policy", "prefix_caching", "cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise SpecDecodeError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise SpecDecodeError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        object.__setattr__(self, "speculative", parse_speculative(self.speculative))
        if self.latency_curve is not None:
            points = tuple((int(t), float(s)) for t, s in self.latency_curve)
            if not points or any(t < 1 or not s > 0 for t, s in points):
                raise SpecDecodeError("latency_curve must be (tokens >= 1, seconds > 0) points")
            object.__setattr__(self, "latency_curve", tuple(sorted(points)))
