"""Prompt lookup: draft by copying what followed the last n-gram the last time it was seen.

Outputs that quote or edit their input (summaries, code edits, extraction) repeat long spans of
the prompt or of themselves. Matching the last few tokens against the text so far and proposing
what came next there costs no model at all, so its draft is free; a wrong draft only wastes
verification slots, never correctness (the tokens are point masses, verified exactly).

The search runs every step over a sequence of up to thousands of tokens, so it is an index, not a
scan: a dictionary from each n-gram (n = 1..max_matching_ngram_size) to the end of its most recent
occurrence. It is brought up to date lazily, at the start of `propose`, with the n-grams ending at
the tokens added since the previous call: O(new tokens x max n-gram size) per step, O(1) per
lookup. It is updated in `propose` rather than `observe` because the engine does not call
`observe` after a step with an empty draft.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specdecode.drafters.base import Drafter, Proposal, StepResult
from specdecode.spec_config import PromptLookupConfig
from specdecode.tree import DraftTree

if TYPE_CHECKING:
    from specdecode.engine import Request


class PromptLookupDrafter(Drafter):
    """Proposes the continuation of the most recent earlier occurrence of the longest matching
    suffix n-gram; with `fallback` (a draft model), lets it draft when nothing matches.

    The sequence searched is `req.all_ids`: prompt plus everything generated, root included. An
    occurrence is "earlier" when it ends before the last token, so the suffix never matches
    itself but may overlap its match (a run "a a a" proposes "a").

    Assumes `req.all_ids` only grows by appending (the engine's contract); `begin` resets it.
    """

    def __init__(self, config: PromptLookupConfig, fallback: Drafter | None = None) -> None:
        self.num_tokens = config.prompt_lookup_num_tokens
        self.max_ngram = config.max_matching_ngram_size
        self.fallback = fallback
        # The engine sizes the request's cache from max_nodes before `begin`: reserve for
        # whichever of the two may draft more.
        self.max_nodes = max(self.num_tokens, fallback.max_nodes if fallback is not None else 0)
        # n-gram (as a tuple) -> end (exclusive) of its most recent occurrence that ends at or
        # before `_indexed`.
        self._last_end: dict[tuple[int, ...], int] = {}
        self._indexed = 0
        # Which source produced the latest proposal: "lookup", "fallback" or "none" (for stats).
        self.last_source = "none"

    # ---- Drafter interface ---------------------------------------------------------------------

    def begin(self, req: Request, prompt_hidden: torch.Tensor | None) -> None:
        """Reset the index (it is rebuilt from `req.all_ids` on the first propose) and start the
        fallback, which must prefill its own cache now whether or not it ever drafts."""
        self._last_end.clear()
        self._indexed = 0
        if self.fallback is not None:
            self.fallback.begin(req, prompt_hidden)

    def propose(self, req: Request) -> Proposal:
        ids = req.all_ids
        room = req.max_len - len(ids)  # draft tokens the target's cache can still take
        if room <= 0:
            self.last_source = "none"
            return Proposal(DraftTree.empty())
        tokens = self.lookup(ids, min(self.num_tokens, room))
        if tokens:
            self.last_source = "lookup"
            return Proposal(DraftTree.chain(tokens))
        if self.fallback is not None:
            self.last_source = "fallback"
            return self.fallback.propose(req)
        self.last_source = "none"
        return Proposal(DraftTree.empty())

    def observe(self, req: Request, result: StepResult) -> None:
        """Forward to the fallback every step, even when lookup drafted, so it can drop draft
        tokens the target rejected and keep its cache in step with `req.all_ids`."""
        if self.fallback is not None:
            self.fallback.observe(req, result)

    # ---- the search ------------------------------------------------------------------------------

    def lookup(self, ids: list[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens that followed the most recent earlier occurrence of the
        longest suffix n-gram of `ids` (n from max_matching_ngram_size down to 1); [] if none."""
        self._catch_up(ids)
        length = len(ids)
        # An earlier occurrence ends at or before length-1, so it needs n <= length-1.
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            end = self._last_end.get(tuple(ids[length - n :]))
            if end is not None:
                return ids[end : end + max_tokens]
        return []

    def _catch_up(self, ids: list[int]) -> None:
        """Index the n-grams ending at positions `_indexed+1 .. len(ids)-1` (exclusive ends).

        The n-grams ending at the very end are left out: they are the suffix being searched for,
        and are indexed on the next call, once a later token follows them."""
        if len(ids) <= self._indexed:  # a shorter sequence: not the one indexed, start over
            self._last_end.clear()
            self._indexed = 0
        index = self._last_end
        for end in range(self._indexed + 1, len(ids)):
            for n in range(1, min(self.max_ngram, end) + 1):
                index[tuple(ids[end - n : end])] = end
        self._indexed = max(self._indexed, len(ids) - 1)
