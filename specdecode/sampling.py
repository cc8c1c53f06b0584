"""Sampling settings and the logits -> probabilities transform they define.

The transform (temperature, then top-k, then top-p) defines the *target distribution* that
lossless speculative sampling must reproduce; temperature 0 means greedy (argmax) decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdecode.errors import SpecDecodeError

MAX_LOGPROBS = 20  # alternatives per token, as vLLM's default limit and OpenAI's chat API allow


@dataclass
class SamplingParams:
    """Per-request generation settings, with the defaults and meanings vLLM users expect.

    temperature 0 is greedy; top_k -1 (or 0) and top_p 1 disable those filters; `stop` strings end
    the output before the string; `stop_token_ids` end it after the token (as end-of-sequence does
    unless `ignore_eos`); `seed` makes sampling reproducible per request. `logprobs` N (None =
    off) asks for each generated token's log-probability and the N most likely alternatives
    (`TokenLogprobs`), at most `MAX_LOGPROBS`.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise SpecDecodeError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:  # also rejects NaN
            raise SpecDecodeError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise SpecDecodeError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise SpecDecodeError(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if any(not s for s in self.stop):
            raise SpecDecodeError("stop strings must be non-empty")
        n = self.logprobs
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_LOGPROBS):
            raise SpecDecodeError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {n!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's index of its largest value, (M, V) -> M ints: `logits.argmax(-1).tolist()`, ties
    and NaN resolved as there (the first maximal index; a NaN counts as the largest). Greedy
    decoding takes one per verified row. On a CPU through numpy, which gives the same indices:
    torch's CPU argmax took ~120 us a row over SmolLM2's 49k vocabulary (as long as the LM head's
    product of a draft row), numpy's ~5 us."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64, torch.float16):
        return logits.detach().numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities of the target distribution (not for greedy)."""
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already cover top_p; the first always stays
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token from a (V,) distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass(frozen=True)
class TokenLogprobs:
    """The target's log-probabilities where one token was generated: `logprob` of the token
    itself and `top`, the N most likely tokens as (token id, logprob), most likely first.

    They are of the model's raw distribution, log_softmax of the float32 logits before
    temperature, top-k and top-p (what vLLM reports by default), so they do not depend on the
    sampling settings, nor on speculation: each comes from the target row that predicted the
    token, whether that row verified a draft or decoded plainly."""

    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: torch.Tensor, tokens: list[int], num_top: int) -> list[TokenLogprobs]:
    """`TokenLogprobs` of each of `tokens` from (E, V) logits, row e being the distribution
    `tokens[e]` was drawn from."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (E, V)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()
    if num_top == 0:
        return [TokenLogprobs(lp, []) for lp in chosen]
    top = torch.topk(logprobs, num_top, dim=-1)  # values, indices: (E, N), sorted descending
    return [
        TokenLogprobs(lp, list(zip(ids, values, strict=True)))
        for lp, ids, values in zip(chosen, top.indices.tolist(), top.values.tolist(), strict=True)
    ]
