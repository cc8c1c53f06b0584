"""How long one target forward over T new tokens takes: the one measurement behind the load
policy's latency curve and `specdecode bench-runtime`'s latency table."""

from __future__ import annotations

import time

import torch

from specdecode.attention import AttentionPlan, Segment
from specdecode.models.transformer import Transformer


@torch.inference_mode()
def forward_seconds(
    model: Transformer, widths: list[int], context: int, repeats: int
) -> dict[int, list[float]]:
    """For each T in `widths`, the seconds of `repeats` timed forwards of T new tokens after a
    `context`-token prefix, each with the greedy LM head on every row (as a greedy verification
    step reads them), after one untimed warm-up. The new tokens are forgotten after each."""
    device = model.device
    cache = model.new_cache(context + max(widths))
    ids = torch.randint(0, model.config.vocab_size, (1, context + max(widths)), device=device)
    model(ids[:, :context], torch.arange(context, device=device)[None], cache)
    out: dict[int, list[float]] = {}
    for t in widths:
        positions = torch.arange(context, context + t, device=device)[None]  # (1, T)
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            hidden = model.forward_plan(ids[:, :t], positions, AttentionPlan([Segment.append(cache, t)]))
            model.greedy_rows(hidden[0])
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:  # the first is the warm-up
                times.append(time.perf_counter() - t0)
            cache.truncate(context)
        out[t] = times
    return out
