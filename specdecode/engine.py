"""The decoding loop for one request: prefill, then steps of (draft → one target forward → accept).

Bookkeeping: the request's last decided token is the *root*. It is not yet in the KV cache; each
step runs the target over `[root] + draft`, keeps the root and the accepted draft tokens in the
cache, and the step's last emitted token becomes the next root. Prefill therefore caches the
prompt without its last token, and plain decoding is simply a step with an empty draft.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch

from specdecode.errors import SpecDecodeError
from specdecode.kv_cache import KVCache
from specdecode.models.transformer import Transformer
from specdecode.outputs import SpecStats, Timing
from specdecode.sampling import SamplingParams, logits_to_probs, sample

PREFILL_CHUNK = 512  # prompt tokens per forward: bounds the attention scores' memory


class Request:
    """State of one generation: tokens so far, its cache, its random stream, its figures."""

    def __init__(
        self,
        model: Transformer,
        prompt_ids: list[int],
        params: SamplingParams,
        eos_token_ids: list[int],
        reserve: int = 0,
    ) -> None:
        context = model.config.max_position_embeddings
        if not prompt_ids:
            raise SpecDecodeError("the prompt is empty")
        if len(prompt_ids) >= context:
            raise SpecDecodeError(
                f"prompt of {len(prompt_ids)} tokens does not fit the model's context of {context} tokens"
            )
        vocab = model.config.vocab_size
        if not all(0 <= t < vocab for t in prompt_ids):
            raise SpecDecodeError(f"prompt token ids must be in [0, {vocab})")
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        # Room for every token this request may produce, plus the widest draft a step may verify.
        self.max_len = min(len(prompt_ids) + params.max_tokens + reserve, context)
        self.cache: KVCache = model.new_cache(self.max_len)
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator(device=model.device).manual_seed(params.seed)
        self.stats = SpecStats()
        self.finish_reason: str | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def root(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def append(self, tokens: list[int]) -> list[int]:
        """Add a step's emitted tokens, cut at a stop token or the length limit; returns those kept."""
        kept: list[int] = []
        limit = min(self.params.max_tokens, self.max_len - len(self.prompt_ids))
        for token in tokens:
            kept.append(token)
            self.output_ids.append(token)
            if token in self.stop_ids:
                self.finish_reason = "stop"
                break
            if len(self.output_ids) >= limit:
                self.finish_reason = "length"
                break
        return kept


class Engine:
    """Runs requests on one target model. `generate` yields each step's newly emitted tokens."""

    def __init__(self, model: Transformer) -> None:
        self.model = model

    @torch.inference_mode()
    def prefill(self, req: Request) -> None:
        """Cache the prompt except its last token (the first root)."""
        ids = req.prompt_ids[:-1]
        device = self.model.device
        for s in range(0, len(ids), PREFILL_CHUNK):
            chunk = torch.tensor([ids[s : s + PREFILL_CHUNK]], device=device)  # (1, T)
            positions = torch.arange(s, s + chunk.shape[1], device=device)[None]  # (1, T)
            self.model(chunk, positions, req.cache)

    @torch.inference_mode()
    def step(self, req: Request) -> list[int]:
        """One target forward over the root; returns the emitted token(s)."""
        cache = req.cache
        start = cache.length
        ids = torch.tensor([[req.root]], device=self.model.device)  # (1, 1)
        positions = torch.tensor([[start]], device=self.model.device)  # (1, 1)
        logits = self.model.logits(self.model(ids, positions, cache)[0, -1])  # (V,)
        if req.params.greedy:
            token = int(logits.argmax())
        else:
            token = sample(logits_to_probs(logits, req.params), req.generator)
        req.stats.record_step(max_depth=0, num_draft=0, num_accepted=0, num_emitted=1)
        return [token]

    def generate(
        self, req: Request, on_prefill: Callable[[float], None] | None = None
    ) -> Iterator[list[int]]:
        """Run `req` to completion, yielding the tokens each step adds."""
        t0 = time.perf_counter()
        self.prefill(req)
        if on_prefill is not None:
            on_prefill(time.perf_counter() - t0)
        while req.finish_reason is None:
            yield req.append(self.step(req))


def run_to_completion(engine: Engine, req: Request) -> Timing:
    """Drive `engine.generate` without streaming and time it."""
    timing = Timing()
    t0 = time.perf_counter()

    def note_prefill(seconds: float) -> None:
        timing.prefill_s = seconds

    for _ in engine.generate(req, note_prefill):
        if not timing.first_token_s:
            timing.first_token_s = time.perf_counter() - t0
    timing.total_s = time.perf_counter() - t0
    timing.num_tokens = len(req.output_ids)
    return timing
