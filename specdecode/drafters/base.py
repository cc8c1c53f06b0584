"""The one interface every speculative method implements.

A drafter is made per request (by `engine.drafter_factory`). After the prompt is cached it is
told so (`begin`); then each step it proposes a draft (`propose`) that the engine verifies in one
target forward, and it is told the outcome (`observe`) so it can advance its own state (a draft
model's cache, an n-gram pool, a feature history).

The prefill contract (one code path in the engine delivers it, however the prompt was cached):
the engine calls `begin` once, when the cache holds the whole prompt but its last token (the
first root), with `prompt_hidden` (P-1, C): the target's hidden states of prompt positions
0 .. P-2. It is the same whether the prompt was prefilled whole, in chunks, or partly or wholly
served from reused KV blocks of the prefix cache (the cache keeps each slot's hidden state beside
its keys and values). Row i is the target's output at prompt position i, so it predicts prompt
token i + 1; a one-token prompt gives (0, C).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from specdecode.request import Proposal, Request, SamplingVerifier, StepResult
from specdecode.tree import DraftTree

__all__ = ["Drafter", "LastRowDrafter", "Proposal", "SamplingVerifier", "StepResult", "opening_proposal"]


class Drafter(ABC):
    """Proposes drafts for one request. `max_nodes` bounds tree nodes + side tokens per step,
    so the engine can size the request's KV cache."""

    max_nodes: int = 0
    # Replaces lossless `verify_sampling` for this drafter's sampled requests when set. Only a
    # deliberately lossy opt-in does so (Medusa's typical acceptance); greedy is always exact.
    sampling_verifier: SamplingVerifier | None = None

    @property
    def max_chain(self) -> int:
        """The most draft tokens a budgeted step proposes. A tree drafter given a budget below its
        whole tree drafts its best chain, as deep as its tree (`propose`), so a budget of d tokens
        means depths 1..d: what the load policy's per-depth acceptance rates describe. (Granted
        as the first nodes of a tree, the d-th token was often a sibling at depth 1, worth a
        fraction of what depth d is: the policy over-stated trees' gains and they lost.)"""
        return self.max_nodes

    def chains(self, budget: int | None) -> bool:
        """Whether a step granted `budget` draft tokens drafts a chain: a budget below the whole
        proposal (see `max_chain`)."""
        return budget is not None and budget < self.max_nodes

    def source(self, req: Request) -> str:
        """Which of its ways of drafting a budgeted step of `req` would take now, for a drafter
        whose ways cost differently (a lookup branch: a copy from the text, or its head's chain):
        the load policy keeps a drafting cost for each. "" for a drafter of one way. A way may
        carry a grade after a colon ("lookup:3": a copy whose occurrence shares 3 tokens of the
        text's end): acceptance is counted per graded way, drafting cost per way (`cost_way`)."""
        return ""

    def way_limit(self, source: str) -> int | None:
        """The most draft tokens the load policy may grant a step that drafts the way `source`
        (one of this drafter's `source` values), or None: as many as it proposes. A copy's
        ("lookup:g", prompt lookup's and a lookup branch's) is `copy_limit`."""
        return copy_limit(source)

    def begin(self, req: Request, prompt_hidden: torch.Tensor) -> None:  # noqa: B027
        """Called once after prefill; `prompt_hidden` (P-1, C) holds the target's rows of prompt
        positions 0 .. P-2 (see the module's prefill contract)."""

    @abstractmethod
    def propose(self, req: Request, budget: int | None = None) -> Proposal:
        """A draft continuing `req.all_ids` (whose last token is the root, not yet verified).
        `budget`: the most draft tokens (nodes + side tokens) the step will verify (None: no
        limit but the request's room); a drafter whose work grows with its draft (a draft
        model's forwards, a head's depths) does only what that many tokens need. A tree drafter
        drafts a chain of at most `max_chain` tokens when the budget is below `max_nodes`. The
        engine trims what is proposed to the budget either way."""

    def observe(self, req: Request, result: StepResult) -> None:  # noqa: B027
        """Learn from the step's outcome; `req.all_ids` already includes the emitted tokens."""

    def release(self) -> None:  # noqa: B027
        """Give back what the drafter holds outside the request (a draft model's paged KV blocks):
        the request finished, was aborted or was preempted. A later `propose` starts over."""


def opening_proposal(req: Request, has_feature: bool) -> Proposal | None:
    """What a drafter that reads the target's features proposes before it can draft, or None
    when it can: nothing when the request's cache has no room for a draft node; for a one-token
    prompt (no target row before its root yet) a one-node guess, the root repeated. An empty draft
    would make the engine take a plain step, which reports no features, so drafting would never
    start; the guess costs one extra row and gets them."""
    if req.max_len - len(req.all_ids) <= 0:
        return Proposal(DraftTree.empty())
    if not has_feature:
        return Proposal(DraftTree.chain([req.root]))
    return None


class LastRowDrafter(Drafter):
    """A drafter that drafts from the target's hidden row whose output is the current root (Medusa,
    ReDrafter): the last prompt row after prefill, then the last accepted node's row each step."""

    hidden: torch.Tensor | None = None  # (C,)

    def begin(self, req: Request, prompt_hidden: torch.Tensor) -> None:
        """Keep the last prompt row: its target output is the prompt's last token, the first root
        (none for a one-token prompt)."""
        self.hidden = prompt_hidden[-1].clone() if prompt_hidden.shape[0] > 0 else None

    def observe(self, req: Request, result: StepResult) -> None:
        accepted = result.verdict.accepted_nodes
        self.hidden = result.hidden[accepted[-1] if accepted else 0].clone()


# Match lengths the load policy counts apart (`PromptLookupDrafter.source`'s "lookup:g"): 1, 2, 3,
# and this many or more.
MATCH_WAYS = 4


def cost_way(source: str) -> str:
    """The way of a `Drafter.source` that its drafting cost is kept for: its grade left off."""
    return source.partition(":")[0]


def copy_limit(source: str) -> int | None:
    """The most tokens the load policy grants a copy of way `source` ("lookup:g", from `Drafter.source`):
    g where its occurrence shares g < MATCH_WAYS tokens with the text's end, else None (no limit,
    or not a copy).

    Why: the policy weighs each deeper token by an upper bound on its acceptance, and after a
    short match those bounds outran what the deeper tokens earned against their rows. SmolLM2 with
    int8 activations on a 2-core Xeon, 48 Spec-Bench first turns of 256 tokens, engines taking
    turns, decoding alone over plain: prompt lookup 1.323x against 1.269x, EAGLE-2 (its lookup
    branch) 1.247x against 1.206x (session 52)."""
    way, _, grade = source.partition(":")
    if way != "lookup" or not grade.isdigit() or not 0 < int(grade) < MATCH_WAYS:
        return None
    return int(grade)
