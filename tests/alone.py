"""Run one request alone through the engine, as the drafter and model tests need it."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from specdecode.drafters.base import Drafter
from specdecode.engine.config import EngineConfig
from specdecode.engine.llm_engine import EngineRequest, LLMEngine
from specdecode.models.transformer import Transformer
from specdecode.request import Request
from specdecode.sampling import SamplingParams


def alone(
    model: Transformer,
    prompt: Sequence[int],
    params: SamplingParams,
    eos_token_ids: Sequence[int] = (),
    drafter: Drafter | None = None,
) -> tuple[Request, Iterator[list[int]]]:
    """The request's state and an iterator over each decoding step's emitted tokens: a batch of
    one on a fresh engine (no policy, no prefix cache), with `drafter` as the caller built it."""
    engine = LLMEngine(
        model, EngineConfig(max_num_seqs=1, policy=False, prefix_caching=False), None, eos_token_ids
    )
    seq = engine.add_request(EngineRequest("alone", list(prompt), params, None), drafter)

    def steps() -> Iterator[list[int]]:
        while engine.has_unfinished():
            for delta in engine.step():
                yield delta.new_token_ids

    return seq.req, steps()


@torch.inference_mode()
def prefill(model: Transformer, req: Request) -> torch.Tensor:
    """Cache `req`'s prompt but its last token in its own (static) cache; returns the target's
    rows of those positions (P-1, C), what the engine hands `Drafter.begin`."""
    ids = torch.tensor([req.prompt_ids[:-1]], device=model.device)  # (1, P-1)
    positions = torch.arange(ids.shape[1], device=model.device)[None]  # (1, P-1)
    return model(ids, positions, req.cache)[0]


def together(
    model: Transformer,
    prompt: Sequence[int],
    params: Sequence[SamplingParams],
    make_drafter: Callable[[], Drafter | None],
) -> list[Request]:
    """One request per entry of `params`, each with a fresh drafter, all decoded together on one
    engine with rows enough that no draft is trimmed and no prefix reuse: each request runs as it
    would alone (sampled ones on their own seeded streams), many times faster than one by one."""
    drafters = [make_drafter() for _ in params]
    widest = 1 + max((d.max_nodes for d in drafters if d is not None), default=0)
    seqs = 64
    config = EngineConfig(
        max_num_seqs=seqs, max_batch_tokens=seqs * widest, policy=False, prefix_caching=False
    )
    engine = LLMEngine(model, config)
    added = [
        engine.add_request(EngineRequest(str(i), list(prompt), p, None), d)
        for i, (p, d) in enumerate(zip(params, drafters, strict=True))
    ]
    while engine.has_unfinished():
        engine.step()
    return [seq.req for seq in added]
