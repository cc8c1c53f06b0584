"""Lookahead decoding (Fu et al., ICML 2024, "Break the Sequential Dependency of LLM Inference
Using Lookahead Decoding"): the target drafts for itself by Jacobi iteration, in the same forward
that verifies.

Every step runs ONE target forward over three groups of tokens:

- the *root* (the last decided token);
- the *verification branch*: up to G n-grams from the pool whose first token is the root; their
  other N-1 tokens are the draft, merged into a prefix tree and verified as usual (point masses,
  so sampling stays lossless);
- the *lookahead branch*: a 2-D window of guesses, run as side tokens (never kept).

The window has N-1 *levels* (the last N-1 Jacobi iterations) of W *columns*. Cell (l, j) holds a
guess for the token at offset l + j from the root. Cell (0, 0) is the root itself, so the branch
adds W(N-1) - 1 side tokens; with the G(N-1) draft nodes that is exactly TensorRT-LLM's
`max_draft_len(W, N, G) = (N-2) + (W-1+G)(N-1)`, and a step never runs more than
`1 + max_draft_len` new tokens.

Under the load policy (a budget below the whole proposal) a step verifies only the pool's newest
n-gram of the root, N-1 tokens at most, and runs no window: the window's rows add no accepted
token to the step that runs them, so a policy that weighs each row by what it adds would pay for
them and never see the return (lookahead lost 4-6% to plain that way on a 2-core CPU; as chains
it gained 6%, alternating A/B runs on 12 Spec-Bench prompts, SmolLM2, AVX-512). The pool then
grows from the context's n-grams (`context_ngrams`); the whole method, window and all, runs with
the policy off (`speculation_policy=False`, `--no-policy`).

Mask (who a side token attends to, besides the cached prefix): cell (l, j) sees the level-0 cells
(0, 0..j) and its own column above level 0, (1, j) .. (l, j). Its context is therefore one
guessed sentence with one token at every offset 0..l+j: level 0 is the current Jacobi guess of the
continuation, and each column extends that guess vertically. Why this shape: the target's argmax
at (l, j) is then the greedy next token after a concrete guessed prefix ending in the column's
own trajectory (0, j) -> (1, j) -> ... -> (l, j), which is exactly the n-gram we store. Each cell
was predicted one step earlier by the cell just below it in the same column (the next-token
prediction at offset l+j-1 lands on offset l+j), so a column is the trajectory of one Jacobi
position through N-1 iterations, and
`[(0, j), (1, j), ..., (N-2, j), argmax at (N-2, j)]` is an n-gram of consecutive greedy guesses.

After the forward: the argmax at every top-level cell (N-2, j) becomes the new top level and the
oldest level is dropped (level l+1 becomes level l, which also moves every cell one offset closer
to the root: exact for a step that emitted one token). When a step emits k > 1 tokens the root
jumps k positions and, as in the paper's implementation, the window simply keeps iterating: its
cells now guess positions k-1 too early, but every column is still a chain of the target's own
greedy predictions. The alternative, `realign=True`, shifts the columns left by k-1 and refills
the freed columns with random context tokens, so surviving cells keep guessing the same absolute
position; on SmolLM2-135M it lowered τ (4,4,4: 1.41 against 1.55 without context n-grams),
because refilled columns need N-2 iterations before they yield n-grams again. Either way the
output is lossless: only verified tokens are ever kept.

The pool maps a first token to at most G continuations of N-1 tokens, most recent first, without
duplicates. It is fed by every column whose trajectory is complete (all N-1 levels produced by
Jacobi iterations, not the random initial fill) and, with `context_ngrams` (on by default), by
the n-grams of the prompt (TensorRT-LLM's pool manager also fills its pool from the prompt) and
of the generated text. Those are exact n-grams of the real context and pay off whenever the text
repeats itself: on SmolLM2-135M they raised τ at (4,4,4) from 1.55 to 1.74.

(1, 1, 0) is plain decoding: empty proposals.
"""

from __future__ import annotations

import functools
import random
from typing import TYPE_CHECKING

import torch

from specdecode.drafters.base import Drafter, Proposal, StepResult
from specdecode.spec_config import LookaheadConfig
from specdecode.tree import DraftTree

if TYPE_CHECKING:
    from specdecode.request import Request


class NgramPool:
    """First token -> up to `capacity` continuations, most recently added first, no duplicates.

    Most-recent-first because recent Jacobi trajectories were computed from the freshest
    context, and the verification budget (G) should go to them first.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._map: dict[int, list[tuple[int, ...]]] = {}

    def add(self, key: int, continuation: tuple[int, ...]) -> None:
        if self.capacity <= 0:
            return
        bucket = self._map.setdefault(key, [])
        if continuation in bucket:
            bucket.remove(continuation)
        bucket.insert(0, continuation)
        del bucket[self.capacity :]

    def get(self, key: int) -> list[tuple[int, ...]]:
        """The continuations of `key`, most recent first (a copy)."""
        return list(self._map.get(key, ()))

    def __len__(self) -> int:
        return sum(len(b) for b in self._map.values())

    def __contains__(self, key: int) -> bool:
        return key in self._map


def ngram_tree(candidates: list[tuple[int, ...]]) -> DraftTree:
    """Merge candidate continuations of the root into a prefix tree (shared prefixes once).

    Merging keeps the forward narrow without losing anything: two candidates that agree on
    their first tokens need those tokens verified only once. Siblings keep the candidates'
    order, so the most recent n-gram is tried first.
    """
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for cand in candidates:
        node = 0
        for token in cand:
            child = index.get((node, token))
            if child is None:
                tokens.append(token)
                parents.append(node)
                child = len(tokens)
                index[(node, token)] = child
            node = child
    return DraftTree(
        torch.tensor(tokens, dtype=torch.long),  # (N,)
        torch.tensor(parents, dtype=torch.long),  # (N,)
    )


@functools.cache
def window_layout(window_size: int, num_levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Offsets and attention among the window's cells, cell (l, j) at flat index l*W + j.

    Cached (a drafter is made per request): callers must not modify the returned tensors.

    Returns `depths` (L*W,) long, the offset l + j of each cell from the root (cell 0 is the
    root), and `mask` (L*W, L*W) bool, True where cell i attends to cell k: the level-0 cells
    of columns <= j and the cells of its own column from level 1 to l (itself included). Every
    cell sees one token per offset 0..l+j, a single consistent guessed continuation.
    """
    w, levels = window_size, num_levels
    level = torch.arange(levels).repeat_interleave(w)  # (L*W,)
    column = torch.arange(w).repeat(levels)  # (L*W,)
    depths = level + column  # (L*W,)
    li, ji = level[:, None], column[:, None]
    lk, jk = level[None, :], column[None, :]
    first_row = (lk == 0) & (jk <= ji)
    own_column = (jk == ji) & (lk >= 1) & (lk <= li)
    return depths, first_row | own_column


class LookaheadDrafter(Drafter):
    """Lookahead decoding for one request, with a (W, N, G) `LookaheadConfig`.

    `context_ngrams`: also pool the n-grams of the prompt and of the generated text.
    `realign`: shift the window's columns when a step emits several tokens (off by default; see
    the module docstring). `seed`: the random initial fill of the window (from the prompt's tokens).
    """

    def __init__(
        self,
        config: LookaheadConfig,
        *,
        context_ngrams: bool = True,
        realign: bool = False,
        seed: int = 0,
    ) -> None:
        self.config = config
        self.plain = config.is_plain
        self.w = config.window_size
        self.n = config.ngram_size
        self.g = config.verification_set_size
        self.levels = max(self.n - 1, 1)
        self.context_ngrams = context_ngrams
        self.realign = realign
        self.max_nodes = 0 if self.plain else config.max_draft_len
        depths, mask = window_layout(self.w, self.levels)
        self._cell_depths = depths  # (L*W,)
        self._cell_mask = mask  # (L*W, L*W)
        self.num_side = 0 if self.plain else self.levels * self.w - 1
        self.pool = NgramPool(self.g)
        self._rng = random.Random(seed)
        # window[l][j]: guess at offset l + j from the current root; window[0][0] is the root.
        self.window: list[list[int]] = []
        # links[j]: how many of column j's N-2 level-to-level links come from Jacobi predictions
        # (the rest of the column is still the random initial fill).
        self.links: list[int] = [0] * self.w
        self._ingested = 0  # prefix length of req.all_ids whose n-grams are in the pool
        self._step_has_window = False

    @property
    def max_chain(self) -> int:
        """A budgeted step verifies one n-gram of the pool, N-1 tokens, without the window (its
        rows only feed the pool: they add no accepted token to the step that runs them)."""
        return self.levels

    # ---- lifecycle ----------------------------------------------------------------------------

    def begin(self, req: Request, prompt_hidden: torch.Tensor) -> None:
        """Fill the window with random prompt tokens: any guess works, Jacobi iterations fix it,
        and tokens of the prompt are likelier than arbitrary vocabulary ids to recur."""
        if self.plain:
            return
        ids = req.all_ids
        self.window = [[self._rng.choice(ids) for _ in range(self.w)] for _ in range(self.levels)]
        self.links = [0] * self.w
        self._ingested = 0

    def propose(self, req: Request, budget: int | None = None) -> Proposal:
        if self.plain:
            return Proposal(DraftTree.empty())
        if not self.window:  # begin() was not called
            self.begin(req, None)
        ids = req.all_ids
        if self.context_ngrams:
            self._ingest(ids)
        root = req.root
        if self.chains(budget):  # the pool's newest n-gram, no window
            self._step_has_window = False
            best = self.pool.get(root)[:1]
            room = min(budget, req.max_len - req.cache.length - 1)
            return Proposal(ngram_tree([best[0][:room]] if best and room > 0 else []))
        tree = ngram_tree(self.pool.get(root)[: self.g])
        # Never outgrow the request's cache (only possible near the model's context limit).
        room = req.max_len - req.cache.length - 1
        side = self.num_side if tree.num_nodes + self.num_side <= room else 0
        if tree.num_nodes > room - side:
            keep = max(room - side, 0)
            tree = DraftTree(tree.tokens[:keep], tree.parents[:keep])
        self._step_has_window = side > 0
        if not side:
            return Proposal(tree)
        self.window[0][0] = root
        n = tree.num_nodes
        cells = torch.tensor([t for row in self.window for t in row], dtype=torch.long)  # (L*W,)
        mask = self._cell_mask[1:]  # (M, L*W), M = L*W - 1
        side_mask = torch.cat(
            [mask[:, :1], torch.zeros(side, n, dtype=torch.bool), mask[:, 1:]], dim=1
        )  # (M, n+1+M)
        return Proposal(
            tree,
            side_tokens=cells[1:],  # (M,)
            side_depths=self._cell_depths[1:].clone(),  # (M,)
            side_mask=side_mask,
        )

    def observe(self, req: Request, result: StepResult) -> None:
        """Advance the window by one Jacobi iteration and pool the completed trajectories."""
        if self.plain or not self._step_has_window or result.side_best is None:
            return
        # Next-token guess at every cell; the root's own row is not among the side rows, but
        # the step's first emitted token is the target's choice there (only used when N = 2).
        preds = [result.verdict.tokens[0], *result.side_best]  # L*W ints
        top = (self.levels - 1) * self.w
        new_row = preds[top : top + self.w]
        full = self.levels - 1  # links a column needs before its trajectory is an n-gram
        for j in reversed(range(self.w)):  # column 0 ends up most recent: its context is real
            if self.links[j] >= full:
                gram = [row[j] for row in self.window] + [new_row[j]]
                self.pool.add(gram[0], tuple(gram[1 : self.n]))
        self.window = [*self.window[1:], new_row]
        self.links = [min(k + 1, full) for k in self.links]
        jump = len(result.verdict.tokens) - 1
        if self.realign and jump > 0:
            self._shift_columns(min(jump, self.w), req.all_ids)

    # ---- helpers ------------------------------------------------------------------------------

    def _shift_columns(self, k: int, ids: list[int]) -> None:
        """The root moved k positions further than one step: drop the first k columns so every
        surviving cell keeps its absolute position, and refill k columns on the right."""
        for row in self.window:
            row[:] = row[k:] + [self._rng.choice(ids) for _ in range(k)]
        self.links = self.links[k:] + [0] * k

    def _ingest(self, ids: list[int]) -> None:
        """Pool every n-gram of `ids` not yet pooled (those ending after `self._ingested`)."""
        n = self.n
        for end in range(max(self._ingested + 1, n), len(ids) + 1):
            gram = ids[end - n : end]
            self.pool.add(gram[0], tuple(gram[1:]))
        self._ingested = max(self._ingested, len(ids))
