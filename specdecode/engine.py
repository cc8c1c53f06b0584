"""The decoding loop for one request: prefill, then steps of (draft → one target forward → accept).

Bookkeeping: the request's last decided token is the *root*. It is not yet in the KV cache; each
step runs the target over `[root] + draft`, keeps the root and the accepted draft tokens in the
cache, and the step's last emitted token becomes the next root. Prefill therefore caches the
prompt without its last token, and plain decoding is simply a step with an empty draft.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from specdecode.attention import AttentionPlan, Segment, tree_mask
from specdecode.drafters.base import Drafter, Proposal, StepResult
from specdecode.errors import SpecDecodeError
from specdecode.kv_cache import SequenceCache
from specdecode.models.transformer import Transformer
from specdecode.outputs import SpecStats, Timing
from specdecode.sampling import SamplingParams, TokenLogprobs, logits_to_probs, sample, token_logprobs
from specdecode.tree import DraftTree
from specdecode.verify import greedy_walk, verify_sampling

PREFILL_CHUNK = 512  # prompt tokens per forward: bounds the attention scores' memory


class Request:
    """State of one generation: tokens so far, its cache, its random stream, its figures."""

    def __init__(
        self,
        model: Transformer,
        prompt_ids: list[int],
        params: SamplingParams,
        eos_token_ids: list[int],
        drafter: Drafter | None = None,
        new_cache: Callable[[int], SequenceCache] | None = None,
    ) -> None:
        """`new_cache(max_len)` makes the request's KV cache; None = a static `KVCache`."""
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
        # Per output token when the request asked for logprobs (`SamplingParams.logprobs`).
        self.logprobs: list[TokenLogprobs] | None = None if params.logprobs is None else []
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.drafter = drafter
        # Room for every token this request may produce, plus the widest draft a step may verify.
        reserve = drafter.max_nodes + 1 if drafter is not None else 0
        self.max_len = min(len(prompt_ids) + params.max_tokens + reserve, context)
        self.cache: SequenceCache = (new_cache or model.new_cache)(self.max_len)
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator(device=model.device).manual_seed(params.seed)
        self.stats = SpecStats()
        self.timing = Timing()
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

    def commit(
        self,
        emitted: list[int],
        result: StepResult | None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> list[int]:
        """Append a step's tokens (and their `logprobs` when the request asked), count it in
        `stats` and let the drafter observe it (unless the request finished); returns the tokens
        kept."""
        tokens = self.append(emitted)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs += logprobs[: len(tokens)]
        if result is None:
            self.stats.record_step(0, 0, 0, len(tokens))
        else:
            accepted = min(result.verdict.num_draft_accepted, len(tokens))
            self.stats.record_step(result.max_depth, result.num_draft, accepted, len(tokens))
            if self.finish_reason is None:
                self.drafter.observe(self, result)  # type: ignore[union-attr]
        return tokens


def step_logprobs(
    model: Transformer,
    req: Request,
    hidden: torch.Tensor,  # (T, C) the step plan's rows, as given to `StepPlan.finish`
    emitted: list[int],
    result: StepResult | None,
) -> list[TokenLogprobs] | None:
    """`TokenLogprobs` of a step's `emitted` tokens when the request asked (else None), each from
    the row that predicted it: the root's for a plain step, else the root and the accepted path
    (`Verdict.kept_indices`), so speculation does not change them."""
    if req.params.logprobs is None:
        return None
    rows = hidden[:1] if result is None else hidden[result.verdict.kept_indices]  # (E, C)
    return token_logprobs(model.logits(rows), emitted, req.params.logprobs)


@dataclass(frozen=True)
class StepPlan:
    """One request's share of a target forward, and how to turn its output rows into tokens.

    The single-request `Engine` runs one plan per forward; the serving engine concatenates the
    plans of every running request into one forward. Either way `prepare` lays out the inputs and
    `finish` verifies, so both share one verification path.

    Input layout: the root, then the draft tree's nodes, then any side tokens. A plain step (no
    proposal) is the root alone, which needs no mask.
    """

    proposal: Proposal | None
    tree: DraftTree | None  # the proposal's tree on the model's device
    ids: torch.Tensor  # (T,) long
    depths: torch.Tensor  # (T,) long: position offsets from the request's cache length
    among_new: torch.Tensor | None  # (T, T) bool: who sees whom among the new tokens

    @classmethod
    def prepare(cls, req: Request, proposal: Proposal | None, device: torch.device) -> StepPlan:
        """Lay out the step's inputs; an empty proposal (or None) makes a plain step."""
        if proposal is None or proposal.tree.num_nodes + proposal.num_side == 0:
            zero = torch.zeros(1, dtype=torch.long, device=device)
            return cls(None, None, torch.tensor([req.root], device=device), zero, None)
        tree = proposal.tree.to(device)
        n, m = tree.num_nodes, proposal.num_side
        depths = tree.depths()  # (N+1,)
        ids = torch.cat([torch.tensor([req.root], device=device), tree.tokens])  # (N+1,)
        among_new = torch.zeros(n + 1 + m, n + 1 + m, dtype=torch.bool, device=device)
        among_new[: n + 1, : n + 1] = tree.ancestor_mask()
        if m:
            assert proposal.side_tokens is not None and proposal.side_depths is not None
            assert proposal.side_mask is not None
            ids = torch.cat([ids, proposal.side_tokens.to(device)])
            depths = torch.cat([depths, proposal.side_depths.to(device)])
            among_new[n + 1 :] = proposal.side_mask.to(device)
        return cls(proposal, tree, ids, depths, among_new)

    @property
    def length(self) -> int:
        return int(self.ids.shape[0])

    def segment(self, cache: SequenceCache) -> Segment:
        """Reserve the plan's slots after the cache's valid prefix: its part of the forward."""
        start = cache.reserve(self.length)
        mask = None if self.among_new is None else tree_mask(start, self.among_new)
        return Segment(cache, start, self.length, mask)

    def finish(
        self,
        model: Transformer,
        req: Request,
        start: int,
        hidden: torch.Tensor,  # (T, C) the forward's rows for this plan
        greedy: Sequence[int] | None = None,
    ) -> tuple[list[int], StepResult | None]:
        """Verify, compact the cache to the root and the accepted path, and return the emitted
        tokens with what the drafter should observe (None for a plain step). `greedy` holds the
        target's greedy token of each row when the caller screened them already (a batch screens
        every greedy request's rows in one pass of the LM head); tokens are resolved lazily, so a
        walk down the tree reads only the rows on its accepted path."""
        if req.params.greedy and greedy is None:
            greedy = model.greedy_rows(hidden)
        if self.tree is None:
            if greedy is not None:
                return [greedy[0]], None
            logits = model.logits(hidden[-1])  # (V,)
            return [sample(logits_to_probs(logits, req.params), req.generator)], None
        tree = self.tree
        n = tree.num_nodes
        side_best = None  # M ints
        if self.length > n + 1 and greedy is not None:
            side_best = [greedy[i] for i in range(n + 1, self.length)]
        elif self.length > n + 1:
            side_best = model.greedy_tokens(hidden[n + 1 :])
        if greedy is not None:
            verdict = greedy_walk(tree, greedy)
        else:
            probs = logits_to_probs(model.logits(hidden[: n + 1]), req.params)
            verify = req.drafter.sampling_verifier if req.drafter is not None else None
            verdict = (verify or verify_sampling)(tree, probs, req.generator)
        req.cache.compact(start, verdict.kept_indices)
        max_depth = int(self.depths[: n + 1].max())
        return verdict.tokens, StepResult(verdict, hidden, side_best, n, max_depth)


class RowSlice(Sequence[int]):
    """Rows `start .. start+length-1` of a lazy sequence of greedy tokens, read only when asked."""

    def __init__(self, rows: Sequence[int], start: int, length: int) -> None:
        self.rows, self.start, self.length = rows, start, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> int:  # type: ignore[override]
        if not 0 <= i < self.length:
            raise IndexError(i)
        return self.rows[self.start + i]


class Engine:
    """Runs requests on one target model. `generate` yields each step's newly emitted tokens."""

    def __init__(self, model: Transformer) -> None:
        self.model = model

    @torch.inference_mode()
    def prefill(self, req: Request) -> torch.Tensor:
        """Cache the prompt except its last token (the first root); returns its hidden states (P-1, C)."""
        ids = req.prompt_ids[:-1]
        device = self.model.device
        hidden = [torch.empty(0, self.model.config.hidden_size, dtype=self.model.dtype, device=device)]
        for s in range(0, len(ids), PREFILL_CHUNK):
            chunk = torch.tensor([ids[s : s + PREFILL_CHUNK]], device=device)  # (1, T)
            positions = torch.arange(s, s + chunk.shape[1], device=device)[None]  # (1, T)
            hidden.append(self.model(chunk, positions, req.cache)[0])
        return torch.cat(hidden)

    @torch.inference_mode()
    def step(self, req: Request) -> tuple[list[int], StepResult | None, list[TokenLogprobs] | None]:
        """One target forward over the root and the drafter's proposal (if any).

        Returns the emitted tokens, for a speculative step what the drafter should observe, and
        the tokens' logprobs when the request asked."""
        proposal = req.drafter.propose(req) if req.drafter is not None else None
        plan = StepPlan.prepare(req, proposal, self.model.device)
        segment = plan.segment(req.cache)
        positions = (segment.start + plan.depths)[None]  # (1, T)
        hidden = self.model.forward_plan(plan.ids[None], positions, AttentionPlan([segment]))[0]
        emitted, result = plan.finish(self.model, req, segment.start, hidden)
        return emitted, result, step_logprobs(self.model, req, hidden, emitted, result)

    @torch.inference_mode()  # for the drafter's own forwards too (EAGLE's head in begin/observe)
    def generate(self, req: Request) -> Iterator[list[int]]:
        """Run `req` until it finishes (or the caller stops iterating and sets `finish_reason`),
        yielding the tokens each step adds; fills `req.timing`."""
        t0 = time.perf_counter()
        prompt_hidden = self.prefill(req)
        if req.drafter is not None:
            req.drafter.begin(req, prompt_hidden)
        req.timing.prefill_s = time.perf_counter() - t0
        while req.finish_reason is None:
            emitted, result, logprobs = self.step(req)
            tokens = req.commit(emitted, result, logprobs)
            now = time.perf_counter() - t0
            req.timing.first_token_s = req.timing.first_token_s or now
            req.timing.total_s = now
            req.timing.num_tokens = len(req.output_ids)
            yield tokens
