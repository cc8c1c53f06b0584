"""Which cache slots each new token of a forward sees: the explicit attention description.

A forward's new tokens are laid out as one row of `T` tokens, split into *segments*, one per
sequence (a single request, or every request of an in-flight batch). Each segment writes its
keys/values into its own cache at `start` and attends to that cache's first `start + length`
slots under its own mask: a causal chain (prefill, plain decoding) or any tree (verification).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdecode.kv_cache import SequenceCache


def causal_mask(start: int, t: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(T, start+T) bool: new token i sees the cached prefix and new tokens 0..i."""
    cols = torch.arange(start + t, device=device)
    rows = torch.arange(t, device=device).unsqueeze(1) + start
    return cols <= rows


def tree_mask(start: int, ancestors: torch.Tensor) -> torch.Tensor:
    """(T, start+T) bool from a tree's (T, T) ancestor-or-self mask: every new token sees the whole
    cached prefix, and among the new tokens only its own root-to-node path."""
    t = ancestors.shape[0]
    prefix = torch.ones(t, start, dtype=torch.bool, device=ancestors.device)
    return torch.cat([prefix, ancestors.bool()], dim=1)


@dataclass(frozen=True)
class Segment:
    """`length` new tokens of one sequence, stored at slots `start..start+length-1` of `cache`.

    `mask` (length, start+length) bool, True = attend; None means a causal chain, which at
    `start == 0` uses the fused causal kernel and otherwise an explicit mask built once here.
    """

    cache: SequenceCache
    start: int
    length: int
    mask: torch.Tensor | None = None

    @classmethod
    def append(cls, cache: SequenceCache, length: int, mask: torch.Tensor | None = None) -> Segment:
        """A segment of `length` tokens after the cache's valid prefix."""
        start = cache.reserve(length)
        if mask is None and length > 1 and start > 0:
            mask = causal_mask(start, length, cache.device)
        return cls(cache, start, length, mask)


class AttentionPlan:
    """The segments of one forward, in the order their tokens appear in the input row."""

    def __init__(self, segments: list[Segment]) -> None:
        self.segments = segments
        self.total = sum(s.length for s in segments)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,  # (B, H, T, D), rotary applied
        k: torch.Tensor,  # (B, H_kv, T, D), rotary applied
        v: torch.Tensor,  # (B, H_kv, T, D)
    ) -> torch.Tensor:
        """Store every segment's keys/values and return the attention output (B, H, T, D)."""
        if len(self.segments) == 1:
            return self._attend_one(self.segments[0], layer, q, k, v)
        outs, s = [], 0
        for seg in self.segments:
            e = s + seg.length
            outs.append(self._attend_one(seg, layer, q[:, :, s:e], k[:, :, s:e], v[:, :, s:e]))
            s = e
        return torch.cat(outs, dim=2)

    @staticmethod
    def _attend_one(
        seg: Segment, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        keys, values = seg.cache.write(layer, k, v, seg.start)  # (B, H_kv, start+T, D)
        gqa = q.shape[1] != k.shape[1]
        if seg.mask is None and seg.length > 1:  # start == 0: a fresh causal chain
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=seg.mask, enable_gqa=gqa)

    def commit(self) -> None:
        """Advance each cache past its new tokens (after every layer has written them)."""
        for seg in self.segments:
            seg.cache.length = seg.start + seg.length
