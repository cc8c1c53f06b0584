"""A prompt-lookup branch grafted onto a trained drafter's tree.

Trained drafters (Medusa, ReDrafter, EAGLE) guess from the target's features; they are good at
what their training answers looked like and poor at copying: a translation that echoes its
source, a summary that quotes its document, an answer stuck in a loop. Prompt lookup is the
reverse: free, and right exactly there. So the tree the model drafter proposes gets one more
path: the tokens that followed the last earlier occurrence of the sequence's last n-gram. Where
the path agrees with the tree it reuses its nodes; the rest is new nodes, tried after the
drafter's own siblings. The verifier decides as for any tree, so output is unchanged, greedy or
sampled (the new nodes are point masses).

Granted fewer tokens than the tree holds (the load policy weighs a tree drafter as its chain,
`Drafter.max_chain`), the branch proposes one chain: the lookup's continuation where the text
has one, which costs nothing, else the drafter's own (in alternating A/B runs on 12 Spec-Bench
prompts, SmolLM2, AVX-512: EAGLE-2 1.03x plain against 0.98x with the head's chain alone,
ReDrafter 1.05x against 0.97x).

The wrapped drafter sees the step's outcome as usual; every trained drafter reads only the
accepted path's tokens and target features, whichever branch proposed them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specdecode.drafters.base import Drafter, Proposal, StepResult
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.spec_config import PromptLookupConfig
from specdecode.tree import DraftTree

if TYPE_CHECKING:
    from specdecode.request import Request


class LookupBranch(Drafter):
    """`inner`'s tree plus the lookup continuation of up to `num_tokens` tokens after the last
    earlier occurrence of the longest suffix n-gram of at most `max_ngram` tokens."""

    def __init__(self, inner: Drafter, num_tokens: int, max_ngram: int = 2) -> None:
        self.inner = inner
        self.lookup = PromptLookupDrafter(
            PromptLookupConfig(prompt_lookup_num_tokens=num_tokens, max_matching_ngram_size=max_ngram)
        )
        self.max_nodes = inner.max_nodes + num_tokens
        self.sampling_verifier = inner.sampling_verifier
        self.grafted = 0  # steps whose tree got lookup nodes (the tests check the branch ran)

    @property
    def max_chain(self) -> int:
        return self.inner.max_chain

    def source(self, req: Request) -> str:
        """Its way now: the lookup's ("lookup:1" .. "lookup:4", graded by how much of the text's
        end its occurrence shares: `PromptLookupDrafter.source`) where an earlier occurrence gives a
        chain, which a budgeted step drafts (a dictionary look-up: ~0.02 ms a token), else
        "inner", the inner drafter's chain (SmolLM2's EAGLE head: ~1.2 ms a token on a 2-core
        Xeon, a head forward a depth). Costed as one, the look-ups' steps made the head's look 4x
        cheaper than it was: the policy granted it 5 tokens where 2 paid, and those steps lost."""
        length = self.lookup.match_length(req.all_ids)  # the look-up once, not again in `lookup.source`
        return f"lookup:{length}" if length else "inner"

    def begin(self, req: Request, prompt_hidden: torch.Tensor) -> None:
        self.lookup.begin(req, prompt_hidden)
        self.inner.begin(req, prompt_hidden)

    def propose(self, req: Request, budget: int | None = None) -> Proposal:
        if self.inner.chains(budget):  # a chain: lookup's, else inner's
            chain = self.lookup.lookup(req.all_ids, min(budget, req.max_len - len(req.all_ids)))
            if chain:
                return Proposal(DraftTree.chain(chain))
        proposal = self.inner.propose(req, budget)
        if proposal.num_side:
            raise AssertionError("a lookup branch needs a drafter without side tokens")
        tree = proposal.tree
        room = min(req.max_len - len(req.all_ids) - tree.num_nodes, self.lookup.num_tokens)
        if budget is not None:  # grafted nodes the trimmed tree could still hold
            room = min(room, budget - tree.num_nodes)
        chain = self.lookup.lookup(req.all_ids, room) if room > 0 else []
        if not chain:
            return proposal
        grafted = tree.graft(chain)
        if grafted is not tree:
            self.grafted += 1
        return Proposal(grafted)

    def observe(self, req: Request, result: StepResult) -> None:
        self.inner.observe(req, result)

    def release(self) -> None:
        self.inner.release()
