"""The serving engine's interface (implementation in progress)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdecode.llm import LLM
from specdecode.outputs import SpecStats
from specdecode.sampling import SamplingParams
from specdecode.serving.config import ServingConfig
from specdecode.spec_config import SpecConfig

__all__ = ["EngineStats", "RequestDelta", "ServeRequest", "ServingConfig", "ServingEngine"]


@dataclass
class ServeRequest:
    """One generation to serve. `speculative` is already parsed (`parse_speculative`); None = plain.
    A caller whose user did not choose passes the engine's default, `ServingConfig.speculative`."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    speculative: SpecConfig | None
    arrival_time: float | None = None


@dataclass
class RequestDelta:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    num_prompt_tokens: int
    num_cached_prompt_tokens: int  # prompt tokens served from reused KV blocks
    stats: SpecStats  # cumulative for the request
    logprobs: list[float] | None = None


@dataclass
class EngineStats:
    """Live counters of the engine (the server's metrics)."""

    num_requests: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_waiting: int = 0
    num_running: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_reused: int = 0
    drafts_proposed: dict[str, int] = field(default_factory=dict)
    drafts_accepted: dict[str, int] = field(default_factory=dict)
    accepted_by_position: dict[str, list[int]] = field(default_factory=dict)
    proposed_by_position: dict[str, list[int]] = field(default_factory=dict)


class ServingEngine:
    def __init__(self, llm: LLM, config: ServingConfig) -> None:
        self.llm = llm
        self.config = config
        self.stats = EngineStats()

    def add_request(self, req: ServeRequest) -> None:
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def step(self) -> list[RequestDelta]:
        raise NotImplementedError

    def has_unfinished(self) -> bool:
        raise NotImplementedError
