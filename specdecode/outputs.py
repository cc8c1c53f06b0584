"""What a finished (or streaming) request returns: text, tokens, speculation figures, timing."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdecode.sampling import TokenLogprobs


@dataclass
class SpecStats:
    """Speculation figures of one request.

    A *target forward* is one pass of the target model over the pending token plus the draft.
    τ (`mean_accepted_length`) is the number of tokens produced per target forward, counting the
    target's own token at the end of each step, so plain decoding has τ = 1.
    `acceptance_by_position[k]` is the share of steps that offered a draft token at depth k+1
    in which one such token was accepted.
    """

    num_target_forwards: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_generated_tokens: int = 0
    proposed_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    # Steps that offered depth k+1 with every depth before it accepted: the load policy's
    # conditional acceptance rate of depth k+1 is accepted / reached.
    reached_by_position: list[int] = field(default_factory=list)

    @property
    def mean_accepted_length(self) -> float:
        return self.num_generated_tokens / self.num_target_forwards if self.num_target_forwards else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [
            a / p if p else 0.0
            for a, p in zip(self.accepted_by_position, self.proposed_by_position, strict=True)
        ]

    def record_step(self, max_depth: int, num_draft: int, num_accepted: int, num_emitted: int) -> None:
        """Count one target forward that offered `num_draft` draft tokens up to depth `max_depth`,
        accepted `num_accepted` of them along one path and emitted `num_emitted` tokens."""
        self.num_target_forwards += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        self.num_generated_tokens += num_emitted
        grow = max_depth - len(self.proposed_by_position)
        if grow > 0:
            self.proposed_by_position += [0] * grow
            self.accepted_by_position += [0] * grow
            self.reached_by_position += [0] * grow
        for k in range(max_depth):
            self.proposed_by_position[k] += 1
            self.accepted_by_position[k] += k < num_accepted
            self.reached_by_position[k] += k <= num_accepted

    def as_dict(self) -> dict[str, object]:
        return {
            "num_target_forwards": self.num_target_forwards,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "acceptance_by_position": [round(a, 4) for a in self.acceptance_by_position],
        }


@dataclass
class Timing:
    """Wall-clock seconds: prefill (prompt forward), time to first token, total."""

    prefill_s: float = 0.0
    first_token_s: float = 0.0
    total_s: float = 0.0
    num_tokens: int = 0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, per second after the first token."""
        span = self.total_s - self.first_token_s
        return (self.num_tokens - 1) / span if self.num_tokens > 1 and span > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "prefill_s": round(self.prefill_s, 4),
            "first_token_s": round(self.first_token_s, 4),
            "total_s": round(self.total_s, 4),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
        }


@dataclass
class RequestOutput:
    """One prompt's result. `token_ids` are the generated tokens only (an end-of-sequence or stop
    token that ended the output included, as in vLLM); `text` excludes special tokens and the
    stop string. `finish_reason` is "stop" (end of sequence, stop token or string) or "length".
    `logprobs`: see `SamplingParams.logprobs`."""

    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: SpecStats
    timing: Timing
    logprobs: list[TokenLogprobs] | None = None  # per token of `token_ids`, when asked

    def as_dict(self) -> dict[str, object]:
        return {
            "prompt": self.prompt,
            "text": self.text,
            "token_ids": self.token_ids,
            "num_prompt_tokens": len(self.prompt_token_ids),
            "num_generated_tokens": len(self.token_ids),
            "finish_reason": self.finish_reason,
            "stats": self.stats.as_dict(),
            "timing": self.timing.as_dict(),
        }
