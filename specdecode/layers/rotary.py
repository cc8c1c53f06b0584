"""Rotary position embeddings: the inverse frequencies (with Llama-3 scaling) and cos/sin tables."""

from __future__ import annotations

import math

import torch
from torch import nn

from specdecode.errors import SpecDecodeError
from specdecode.models.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies (D/2,), with Llama-3 style scaling when the config asks for it."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind != "llama3":
        raise SpecDecodeError(f"unsupported rope_scaling type {kind!r} (supported: default, llama3)")
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_mid, mid, scaled)


class Rotary(nn.Module):
    """Precomputed cos/sin tables (max_pos, D), indexed by each token's position."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(config.max_position_embeddings).float(), rope_inv_freq(config))
        emb = torch.cat([freqs, freqs], dim=-1)  # (max_pos, D)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions (B, T) -> cos, sin (B, 1, T, D), broadcast over heads
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)
