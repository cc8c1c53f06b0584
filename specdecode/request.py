"""A request's decoding state and one step's plan: the bottom layer every other one builds on.

Bookkeeping: the request's last decided token is the *root*. It is not yet in the KV cache; each
step runs the target over `[root] + draft`, keeps the root and the accepted draft tokens in the
cache, and the step's last emitted token becomes the next root. Prefill therefore caches the
prompt without its last token, and plain decoding is simply a step with an empty draft.

Vocabulary: a *proposal* is what a drafter offers for one step (a draft tree, plus side tokens
for methods that learn from the target's outputs on non-candidates); the *verdict* (`verify`) says
which draft tokens were accepted; the `StepResult` is what a drafter observes afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdecode.attention import Segment, tree_mask
from specdecode.errors import SpecDecodeError
from specdecode.kv_cache import SequenceCache
from specdecode.models.transformer import Transformer
from specdecode.outputs import SpecStats, Timing
from specdecode.sampling import SamplingParams, TokenLogprobs, logits_to_probs, sample, token_logprobs
from specdecode.tree import DraftTree
from specdecode.verify import Verdict, greedy_walk, verify_sampling

# (tree, target_probs (N+1, V), generator) -> Verdict, as `verify_sampling`.
SamplingVerifier = Callable[[DraftTree, torch.Tensor, "torch.Generator | None"], Verdict]


@dataclass(frozen=True)
class Proposal:
    """A draft tree, plus optional *side tokens* the target should also run but not verify.

    Side tokens serve methods that learn from the target's outputs on guesses that are not
    candidates (lookahead's Jacobi window). They follow the tree in the forward input, at
    positions `root position + side_depths`, and attend to the cached prefix plus the new tokens
    chosen by `side_mask`; their KV entries are always discarded after the step.
    """

    tree: DraftTree
    side_tokens: torch.Tensor | None = None  # (M,) long
    side_depths: torch.Tensor | None = None  # (M,) long, >= 1
    side_mask: torch.Tensor | None = None  # (M, N+1+M) bool over [root, tree nodes, side tokens]

    @property
    def num_side(self) -> int:
        return 0 if self.side_tokens is None else int(self.side_tokens.numel())


@dataclass(frozen=True)
class StepResult:
    """What the target produced for a proposal, given to `Drafter.observe`."""

    verdict: Verdict
    hidden: torch.Tensor  # (N+1+M, C) target hidden states (after the final norm) of every input row
    # (M,) the target's greedy token after each side token: all lookahead needs of their logits,
    # read through the screened head (`Transformer.greedy_tokens`) at half the bytes of the logits
    side_best: list[int] | None
    num_draft: int  # N, draft tokens offered
    max_depth: int  # depth of the deepest draft node

    @classmethod
    def plain(cls, token: int, hidden: torch.Tensor) -> StepResult:
        """A step that verified no draft: `token` followed the root, whose row is hidden[0]."""
        return cls(Verdict([], [token]), hidden[:1], None, 0, 0)


class Request:
    """State of one generation: tokens so far, its cache, its random stream, its figures."""

    def __init__(
        self,
        model: Transformer,
        prompt_ids: list[int],
        params: SamplingParams,
        eos_token_ids: list[int],
        max_draft: int = 0,
        new_cache: Callable[[int], SequenceCache] | None = None,
    ) -> None:
        """`max_draft` is the widest proposal (tree nodes + side tokens) a step may verify, so the
        cache has room for it; `new_cache(max_len)` makes the request's KV cache (None = a static
        `KVCache`)."""
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
        # Room for every token this request may produce, plus the widest draft a step may verify.
        reserve = max_draft + 1 if max_draft else 0
        self.max_len = min(len(prompt_ids) + params.max_tokens + reserve, context)
        self.cache: SequenceCache = (new_cache or model.new_cache)(self.max_len)
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator(device=model.device).manual_seed(params.seed)
        self.stats = SpecStats()
        self.timing = Timing()
        # (L-1, C) the target's hidden state of every position but the last, when the engine was
        # asked to keep them (`EngineRequest.return_hidden`) and the request finished.
        self.hidden_states: torch.Tensor | None = None
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
        """Append a step's tokens (and their `logprobs` when the request asked) and count it in
        `stats`; returns the tokens kept."""
        tokens = self.append(emitted)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs += logprobs[: len(tokens)]
        if result is None:
            self.stats.record_step(0, 0, 0, len(tokens))
        else:
            accepted = min(result.verdict.num_draft_accepted, len(tokens))
            self.stats.record_step(result.max_depth, result.num_draft, accepted, len(tokens))
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

    The engine concatenates the plans of every running request into one forward; `prepare` lays
    out a request's inputs and `finish` verifies its rows.

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
        ids = torch.tensor([req.root, *tree.token_ids], device=device)  # (N+1,)
        depths = tree.depths()  # (N+1,)
        if not m:
            return cls(proposal, tree, ids, depths, tree.ancestor_mask())
        assert proposal.side_tokens is not None and proposal.side_depths is not None
        assert proposal.side_mask is not None
        among_new = torch.zeros(n + 1 + m, n + 1 + m, dtype=torch.bool, device=device)
        among_new[: n + 1, : n + 1] = tree.ancestor_mask()
        among_new[n + 1 :] = proposal.side_mask.to(device)
        ids = torch.cat([ids, proposal.side_tokens.to(device)])
        depths = torch.cat([depths, proposal.side_depths.to(device)])
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
        sampling_verifier: SamplingVerifier | None = None,
    ) -> tuple[list[int], StepResult | None]:
        """Verify, compact the cache to the root and the accepted path, and return the emitted
        tokens with what the drafter should observe (None for a plain step). `greedy` holds the
        target's greedy token of each row when the caller screened them already (a batch screens
        every greedy request's rows in one pass of the LM head); tokens are resolved lazily, so a
        walk down the tree reads only the rows on its accepted path. `sampling_verifier` replaces
        lossless `verify_sampling` for sampled requests (the drafter's deliberate opt-in)."""
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
            verdict = (sampling_verifier or verify_sampling)(tree, probs, req.generator)
        req.cache.compact(start, verdict.kept_indices)
        return verdict.tokens, StepResult(verdict, hidden, side_best, n, max(tree.depth_ids))


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
