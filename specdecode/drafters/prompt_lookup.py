"""Prompt lookup: draft by copying what followed the last n-gram the last time it was seen.

Outputs that quote or edit their input (summaries, code edits, extraction) repeat long spans of
the prompt or of themselves. Matching the last few tokens against the text so far and proposing
what came next there costs no model at all, so its draft is free; a wrong draft only wastes
verification slots, never correctness (the tokens are point masses, verified exactly).

The most recent occurrence is often not the one the target continues (a summary reuses "the"
and "of the" everywhere), so with `num_candidates` > 1 the draft is a tree: the continuations of
several occurrences whose first tokens differ, longest n-gram first, then most recent. The target
checks them all in the one forward; the extra root children cost only verification width.

The search runs every step over a sequence of up to thousands of tokens, so it is an index, not a
scan: a dictionary from each n-gram (n = 1..max_matching_ngram_size) to the ends of its most
recent occurrences. It is brought up to date lazily, at the start of `propose`, with the n-grams ending at
the tokens added since the previous call: O(new tokens x max n-gram size) per step, O(1) per
lookup. It is updated in `propose` rather than `observe` because the engine does not call
`observe` after a step with an empty draft.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specdecode.drafters.base import MATCH_WAYS, Drafter, Proposal, StepResult
from specdecode.spec_config import PromptLookupConfig
from specdecode.tree import DraftTree

if TYPE_CHECKING:
    from specdecode.request import Request


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
        self.num_candidates = config.num_candidates
        # Candidates after the first are shorter: they are less likely, and each token widens the
        # verification forward.
        self.other_tokens = max(1, self.num_tokens // 2)
        self.fallback = fallback
        # The engine sizes the request's cache from max_nodes before `begin`: reserve for
        # whichever of the two may draft more.
        lookup_nodes = self.num_tokens + (self.num_candidates - 1) * self.other_tokens
        self.max_nodes = max(lookup_nodes, fallback.max_nodes if fallback is not None else 0)
        # n-gram (as a tuple) -> ends (exclusive) of its most recent occurrences, newest first, at
        # most `num_candidates`, all at or before `_indexed`.
        self._last_end: dict[tuple[int, ...], list[int]] = {}
        self._indexed = 0
        # Which source produced the latest proposal: "lookup", "fallback" or "none" (for stats).
        self.last_source = "none"

    # ---- Drafter interface ---------------------------------------------------------------------

    def source(self, req: Request) -> str:
        """Its way now, for the load policy: "lookup:1" .. "lookup:4", graded by how many tokens
        of the text's end its continuation's occurrence shares (4: four or more; `match_length`;
        acceptance is counted per grade, the copy's cost once); where nothing matches,
        "fallback" when a draft model drafts, else "lookup:0" (a look-up that finds nothing
        costs what one that finds something does; its step is plain).

        How sure a copy is depends on that length: SmolLM2 on 12 Spec-Bench first turns, four
        tokens drafted every step, accepted 0.55 a step after a match of one token (one in four
        steps had its first right), 0.93 after two, 1.3 after three and 2.6-2.9 after four or
        more (the first right in 80-100%). Counted as one way, the policy granted every step the
        budget of their mixture: too much after a weak match and too little after a strong one."""
        length = self.match_length(req.all_ids)
        return "fallback" if not length and self.fallback is not None else f"lookup:{length}"

    def begin(self, req: Request, prompt_hidden: torch.Tensor) -> None:
        """Reset the index (it is rebuilt from `req.all_ids` on the first propose) and start the
        fallback, which must prefill its own cache now whether or not it ever drafts."""
        self._last_end.clear()
        self._indexed = 0
        if self.fallback is not None:
            self.fallback.begin(req, prompt_hidden)

    def propose(self, req: Request, budget: int | None = None) -> Proposal:
        ids = req.all_ids
        room = req.max_len - len(ids)  # draft tokens the target's cache can still take
        if room <= 0:
            self.last_source = "none"
            return Proposal(DraftTree.empty())
        candidates = self.lookup_candidates(ids, room)
        if candidates:
            self.last_source = "lookup"
            return Proposal(candidate_tree(candidates))
        if self.fallback is not None:
            self.last_source = "fallback"
            return self.fallback.propose(req, budget)
        self.last_source = "none"
        return Proposal(DraftTree.empty())

    def observe(self, req: Request, result: StepResult) -> None:
        """Forward to the fallback every step, even when lookup drafted, so it can drop draft
        tokens the target rejected and keep its cache in step with `req.all_ids`."""
        if self.fallback is not None:
            self.fallback.observe(req, result)

    def release(self) -> None:
        if self.fallback is not None:
            self.fallback.release()

    # ---- the search ------------------------------------------------------------------------------

    def lookup(self, ids: list[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens that followed the most recent earlier occurrence of the
        longest suffix n-gram of `ids` (n from max_matching_ngram_size down to 1); [] if none."""
        found = self._continuations(ids, max_tokens, 1)
        return found[0] if found else []

    def lookup_candidates(self, ids: list[int], room: int) -> list[list[int]]:
        """The continuations to verify: the best one up to `prompt_lookup_num_tokens` long, then up
        to `num_candidates - 1` shorter ones with other first tokens; at most `room` tokens in all."""
        found = self._continuations(ids, self.num_tokens, self.num_candidates)
        out: list[list[int]] = []
        for i, cont in enumerate(found):
            cont = cont[: min(self.num_tokens if i == 0 else self.other_tokens, room)]
            if not cont:
                break
            out.append(cont)
            room -= len(cont)
        return out

    def match_length(self, ids: list[int]) -> int:
        """How many tokens at the end of `ids` the best continuation's occurrence also ends with
        (its n-gram, then as far back as the two agree; at most MATCH_WAYS): 0 where nothing
        matches. A longer match is a surer draft (see `source`)."""
        ends = self._ends(ids, 1)
        if not ends:
            return 0
        end, length, n = ends[0], len(ids), 1
        while n < MATCH_WAYS and n < end and ids[end - n - 1] == ids[length - n - 1]:
            n += 1
        return n

    def _continuations(self, ids: list[int], max_tokens: int, limit: int) -> list[list[int]]:
        """Up to `limit` continuations (each up to `max_tokens`) of earlier occurrences of suffix
        n-grams, longest n first, newest first, with pairwise different first tokens."""
        return [ids[end : end + max_tokens] for end in self._ends(ids, limit)]

    def _ends(self, ids: list[int], limit: int) -> list[int]:
        """The ends of up to `limit` earlier occurrences of suffix n-grams, longest n first, newest
        first, whose next tokens differ pairwise."""
        self._catch_up(ids)
        length = len(ids)
        found: list[int] = []
        firsts: set[int] = set()
        # An earlier occurrence ends at or before length-1, so it needs n <= length-1.
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            for end in self._last_end.get(tuple(ids[length - n :]), ()):
                if ids[end] not in firsts:
                    firsts.add(ids[end])
                    found.append(end)
                    if len(found) == limit:
                        return found
        return found

    def _catch_up(self, ids: list[int]) -> None:
        """Index the n-grams ending at positions `_indexed+1 .. len(ids)-1` (exclusive ends).

        The n-grams ending at the very end are left out: they are the suffix being searched for,
        and are indexed on the next call, once a later token follows them."""
        if len(ids) <= self._indexed:  # a shorter sequence: not the one indexed, start over
            self._last_end.clear()
            self._indexed = 0
        index = self._last_end
        keep = self.num_candidates
        for end in range(self._indexed + 1, len(ids)):
            for n in range(1, min(self.max_ngram, end) + 1):
                ends = index.setdefault(tuple(ids[end - n : end]), [])
                ends.insert(0, end)
                del ends[keep:]
        self._indexed = max(self._indexed, len(ids) - 1)


def candidate_tree(candidates: list[list[int]]) -> DraftTree:
    """A tree whose root children start the candidate chains (first tokens pairwise distinct)."""
    tokens: list[int] = []
    parents: list[int] = []
    for cont in candidates:
        for j, token in enumerate(cont):
            parents.append(0 if j == 0 else len(tokens))  # node numbers start at 1
            tokens.append(token)
    return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))
