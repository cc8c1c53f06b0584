"""The one interface every speculative method implements.

A drafter is made per request. After the prompt is cached it is told so (`begin`); then each
step it proposes a draft (`propose`) that the engine verifies in one target forward, and it is
told the outcome (`observe`) so it can advance its own state (a draft model's cache, an n-gram
pool, a feature history).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdecode.tree import DraftTree
from specdecode.verify import Verdict

if TYPE_CHECKING:
    from specdecode.engine import Request

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


class Drafter(ABC):
    """Proposes drafts for one request. `max_nodes` bounds tree nodes + side tokens per step,
    so the engine can size the request's KV cache."""

    max_nodes: int = 0
    # Replaces lossless `verify_sampling` for this drafter's sampled requests when set. Only a
    # deliberately lossy opt-in does so (Medusa's typical acceptance); greedy is always exact.
    sampling_verifier: SamplingVerifier | None = None

    def begin(self, req: Request, prompt_hidden: torch.Tensor | None) -> None:  # noqa: B027
        """Called once after prefill; `prompt_hidden` is (P-1, C), the prompt without its last token."""

    @abstractmethod
    def propose(self, req: Request) -> Proposal:
        """A draft continuing `req.all_ids` (whose last token is the root, not yet verified)."""

    def observe(self, req: Request, result: StepResult) -> None:  # noqa: B027
        """Learn from the step's outcome; `req.all_ids` already includes the emitted tokens."""

    def release(self) -> None:  # noqa: B027
        """Give back what the drafter holds outside the request (a draft model's paged KV blocks):
        the request finished, was aborted or was preempted. A later `propose` starts over."""
