"""The decoding loop for one request: prefill, then steps of (draft → one target forward → accept).

Bookkeeping: the request's last decided token is the *root*. It is not yet in the KV cache; each
step runs the target over `[root] + draft`, keeps the root and the accepted draft tokens in the
cache, and the step's last emitted token becomes the next root. Prefill therefore caches the
prompt without its last token, and plain decoding is simply a step with an empty draft.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from specdecode.attention import tree_mask
from specdecode.drafters.base import Drafter, Proposal, StepResult
from specdecode.errors import SpecDecodeError
from specdecode.kv_cache import KVCache
from specdecode.models.transformer import Transformer
from specdecode.outputs import SpecStats, Timing
from specdecode.sampling import SamplingParams, logits_to_probs, sample
from specdecode.tree import DraftTree
from specdecode.verify import Verdict, greedy_walk, verify_sampling

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
        self.drafter = drafter
        # Room for every token this request may produce, plus the widest draft a step may verify.
        reserve = drafter.max_nodes + 1 if drafter is not None else 0
        self.max_len = min(len(prompt_ids) + params.max_tokens + reserve, context)
        self.cache: KVCache = model.new_cache(self.max_len)
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
    def step(self, req: Request) -> tuple[list[int], StepResult | None]:
        """One target forward over the root and the drafter's proposal (if any).

        Returns the emitted tokens and, for a speculative step, what the drafter should observe."""
        proposal = req.drafter.propose(req) if req.drafter is not None else None
        if proposal is None or proposal.tree.num_nodes + proposal.num_side == 0:
            return self._plain_step(req), None
        return self._speculative_step(req, proposal)

    def _plain_step(self, req: Request) -> list[int]:
        start = req.cache.length
        ids = torch.tensor([[req.root]], device=self.model.device)  # (1, 1)
        positions = torch.tensor([[start]], device=self.model.device)  # (1, 1)
        hidden = self.model(ids, positions, req.cache)[0]  # (1, C)
        if req.params.greedy:
            return self.model.greedy_tokens(hidden)
        logits = self.model.logits(hidden[-1])  # (V,)
        return [sample(logits_to_probs(logits, req.params), req.generator)]

    def _speculative_step(self, req: Request, proposal: Proposal) -> tuple[list[int], StepResult]:
        device = self.model.device
        tree = proposal.tree.to(device)
        n, m = tree.num_nodes, proposal.num_side
        start = req.cache.length
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
        hidden = self.model(ids[None], (start + depths)[None], req.cache, tree_mask(start, among_new))[0]
        side_logits = self.model.logits(hidden[n + 1 :]) if m else None  # (M, V)
        if req.params.greedy:
            verdict = self._verify_greedy(tree, hidden[: n + 1])
        else:
            probs = logits_to_probs(self.model.logits(hidden[: n + 1]), req.params)
            verify = req.drafter.sampling_verifier if req.drafter is not None else None
            verdict = (verify or verify_sampling)(tree, probs, req.generator)
        req.cache.compact(start, verdict.kept_indices)
        max_depth = int(depths[: n + 1].max())
        return verdict.tokens, StepResult(verdict, hidden, side_logits, n, max_depth)

    def _verify_greedy(self, tree: DraftTree, hidden: torch.Tensor) -> Verdict:
        """`verify_greedy`, running the LM head on the root row first. On a small model the head
        costs about a third of a forward and several rows cost much more than one; when no child
        of the root is the target's choice (the most common outcome) that one row decides."""
        best = self.model.greedy_tokens(hidden[:1])  # hidden (N+1, C)
        if not bool((tree.tokens[tree.parents == 0] == best[0]).any()):
            return Verdict([], best)
        return greedy_walk(tree, best + self.model.greedy_tokens(hidden[1:]))

    def generate(self, req: Request) -> Iterator[list[int]]:
        """Run `req` until it finishes (or the caller stops iterating and sets `finish_reason`),
        yielding the tokens each step adds; fills `req.timing`."""
        t0 = time.perf_counter()
        prompt_hidden = self.prefill(req)
        if req.drafter is not None:
            req.drafter.begin(req, prompt_hidden)
        req.timing.prefill_s = time.perf_counter() - t0
        while req.finish_reason is None:
            emitted, result = self.step(req)
            tokens = req.append(emitted)
            if result is None:
                req.stats.record_step(0, 0, 0, len(tokens))
            else:
                accepted = min(result.verdict.num_draft_accepted, len(tokens))
                req.stats.record_step(result.max_depth, result.num_draft, accepted, len(tokens))
            if result is not None and req.finish_reason is None:
                req.drafter.observe(req, result)  # type: ignore[union-attr]
            now = time.perf_counter() - t0
            req.timing.first_token_s = req.timing.first_token_s or now
            req.timing.total_s = now
            req.timing.num_tokens = len(req.output_ids)
            yield tokens
