"""How long one target forward over T new tokens takes: the one measurement behind the load
policy's latency curve and `specdecode bench-runtime`'s latency table."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from specdecode.attention import AttentionPlan, Segment
from specdecode.kv_cache import SequenceCache
from specdecode.models.transformer import Transformer

# How a timed forward runs its rows: (ids (T,), positions (T,), their segment) -> hidden (T, C)
Forward = Callable[[torch.Tensor, torch.Tensor, Segment], torch.Tensor]


@torch.inference_mode()
def forward_seconds(
    model: Transformer,
    widths: list[int],
    context: int,
    repeats: int,
    cache: SequenceCache | None = None,
    forward: Forward | None = None,
) -> dict[int, list[float]]:
    """For each T in `widths`, the seconds of `repeats` timed forwards of T new tokens after a
    `context`-token prefix, each with the greedy LM head on every row (as a greedy verification
    step reads them), after one untimed warm-up. The new tokens are forgotten after each.
    `cache` (empty, room for the prefix and the widest forward; a static one by default) holds
    them; `forward` runs the rows (the model's `forward_plan` by default; the engine's CUDA
    graphs: `GraphRunner.seconds`)."""
    device = model.device
    cache = cache if cache is not None else model.new_cache(context + max(widths))
    run = forward or (lambda ids, pos, seg: model.forward_plan(ids[None], pos[None], AttentionPlan([seg]))[0])
    ids = torch.randint(0, model.config.vocab_size, (context + max(widths),), device=device)
    prompt = AttentionPlan([Segment.append(cache, context)])
    model.forward_plan(ids[None, :context], torch.arange(context, device=device)[None], prompt)
    prompt.commit()
    out: dict[int, list[float]] = {}
    for t in widths:
        positions = torch.arange(context, context + t, device=device)  # (T,)
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            model.greedy_rows(run(ids[:t], positions, Segment.append(cache, t)))
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:  # the first is the warm-up
                times.append(time.perf_counter() - t0)
            cache.truncate(context)
        out[t] = times
    return out
