"""Run one request alone through the engine, as the drafter and model tests need it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from specdecode.drafters.base import Drafter
from specdecode.engine.config import EngineConfig
from specdecode.engine.llm_engine import EngineRequest, LLMEngine
from specdecode.models.transformer import Transformer
from specdecode.request import Proposal, Request
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


def run(model: Transformer, prompt: list[int], drafter: Drafter | None, params: SamplingParams) -> Request:
    """`prompt` decoded alone to its end with `drafter` (None: plainly): the finished request."""
    req, steps = alone(model, prompt, params, [], drafter)
    for _ in steps:
        pass
    return req


def greedy(max_tokens: int = 64) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def exact_greedy(model: Transformer, prompt: list[int], drafter: Drafter, max_tokens: int = 64) -> Request:
    """`prompt` decoded greedily with `drafter`, checked token for token against plain greedy
    decoding (what every speculative method must give): the speculative request."""
    spec = run(model, prompt, drafter, greedy(max_tokens))
    assert spec.output_ids == run(model, prompt, None, greedy(max_tokens)).output_ids, prompt
    return spec


def tau(reqs: Iterable[Request]) -> float:
    """τ of `reqs` together: the tokens they generated per target forward."""
    done = list(reqs)
    return sum(r.stats.num_generated_tokens for r in done) / sum(r.stats.num_target_forwards for r in done)


@torch.inference_mode()
def prefill(model: Transformer, req: Request) -> torch.Tensor:
    """Cache `req`'s prompt but its last token in its own (static) cache; returns the target's
    rows of those positions (P-1, C), what the engine hands `Drafter.begin`."""
    ids = torch.tensor([req.prompt_ids[:-1]], device=model.device)  # (1, P-1)
    positions = torch.arange(ids.shape[1], device=model.device)[None]  # (1, P-1)
    return model(ids, positions, req.cache)[0]


def proposal(drafter: Drafter, model: Transformer, prompt: list[int]) -> Proposal:
    """`drafter`'s first proposal for a greedy request of `prompt`, begun on the prompt's rows
    (`prefill`) as the engine begins it."""
    req = Request(model, prompt, greedy(8), [], drafter.max_nodes)
    drafter.begin(req, prefill(model, req))
    return drafter.propose(req)


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
