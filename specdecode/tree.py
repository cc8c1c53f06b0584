"""The draft tree: what every speculative method hands the verifier.

Terms used throughout specdecode:

- *root*: the last token already decided but not yet in the KV cache. It is index 0 of the
  verification forward pass.
- *node*: one draft token. The forward input is `[root] + tokens`, so the N draft nodes are
  numbered 1..N and node i sits at forward index i. Index 0 always means the root.
- *parent*: the node (or root) whose continuation a node proposes. Nodes are stored in
  topological order: a node's parent has a smaller index.
- *depth*: number of edges from the root (root 0, its children 1, ...). The position id of forward
  index i is `cache_len + depth[i]`.
- *chain*: the tree in which node i's parent is i-1 (a single path).
- *path*: the nodes from the root down to a leaf, root excluded.

The target logits at forward index i give the distribution of the token that follows node i, so
the verifier compares row i with the tokens of i's children.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from specdecode.errors import SpecDecodeError


@dataclass(frozen=True, eq=False)
class DraftTree:
    """A tree of draft tokens, in the numbering of the verification forward input.

    `tokens[i-1]` and `parents[i-1]` describe node i (i = 1..N); `parents[i-1]` is in 0..i-1,
    0 meaning the root. `draft_probs[i-1]` is the distribution node i's token was drawn from
    (the draft's, already temperature/top-k/top-p processed, over the target's vocabulary), given
    its context and its earlier siblings; None when the draft has no probabilities (prompt
    lookup, lookahead, top-k picks), which the verifier treats as point masses on the tokens.
    Siblings are tried in increasing node index, so a drafter numbers them in the order it drew
    them. Equality is identity (tensors have no single truth value).
    """

    tokens: Tensor  # (N,) long
    parents: Tensor  # (N,) long
    draft_probs: Tensor | None = None  # (N, V) float
    # Host copies, set by `__post_init__` from the tensors: N ints each, depth_ids N+1.
    token_ids: list[int] = field(init=False, repr=False)
    parent_ids: list[int] = field(init=False, repr=False)
    depth_ids: list[int] = field(init=False, repr=False)  # depth of each forward index, root 0

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1 or self.tokens.dtype != torch.long:
            raise ValueError(
                f"DraftTree.tokens must be a 1-D long tensor, got {tuple(self.tokens.shape)} "
                f"{self.tokens.dtype}"
            )
        if self.parents.shape != self.tokens.shape or self.parents.dtype != torch.long:
            raise ValueError(
                f"DraftTree.parents must be a long tensor shaped like tokens {tuple(self.tokens.shape)}, "
                f"got {tuple(self.parents.shape)} {self.parents.dtype}"
            )
        if self.parents.device != self.tokens.device:
            raise ValueError("DraftTree.tokens and DraftTree.parents are on different devices")
        # Host copies, read once: the checks, the masks and the verifier's walk use them (a tree
        # is a few dozen nodes, and each small tensor op here cost as much as the whole list).
        tokens, parents = self.tokens.tolist(), self.parents.tolist()
        object.__setattr__(self, "token_ids", tokens)
        object.__setattr__(self, "parent_ids", parents)
        n = len(tokens)
        if n and min(tokens) < 0:
            raise ValueError("DraftTree.tokens must be non-negative token ids")
        if any(not 0 <= p < i for i, p in enumerate(parents, start=1)):
            raise ValueError(
                "DraftTree.parents must satisfy 0 <= parents[i-1] < i for node i "
                f"(topological order), got {parents}"
            )
        if self.draft_probs is not None:
            q = self.draft_probs
            if q.dim() != 2 or q.shape[0] != n or q.shape[1] == 0 or not q.is_floating_point():
                raise ValueError(
                    f"DraftTree.draft_probs must be a float (N={n}, V) tensor, got {tuple(q.shape)} {q.dtype}"
                )
            if n and max(tokens) >= q.shape[1]:
                raise ValueError(f"DraftTree.tokens has an id >= the vocabulary size {q.shape[1]}")
        depths = [0]  # of every forward index, the root's first
        for p in parents:
            depths.append(depths[p] + 1)
        object.__setattr__(self, "depth_ids", depths)

    # ----------------------------------------------------------------------------------------
    # Constructors

    @classmethod
    def chain(cls, tokens: Tensor | Sequence[int], draft_probs: Tensor | None = None) -> DraftTree:
        """A single path: node i's parent is i-1 (node 1's parent is the root)."""
        t = torch.as_tensor(tokens, dtype=torch.long)  # (N,)
        parents = torch.arange(t.shape[0], dtype=torch.long, device=t.device)  # (N,)
        return cls(t, parents, draft_probs)

    @classmethod
    def empty(cls, device: torch.device | str | None = None) -> DraftTree:
        """No draft at all: verification degenerates to one step of plain decoding."""
        z = torch.zeros(0, dtype=torch.long, device=device)  # (0,)
        return cls(z, z.clone())

    # ----------------------------------------------------------------------------------------
    # Structure

    def to(self, device: torch.device | str) -> DraftTree:
        """The same tree on `device` (itself when already there)."""
        if self.tokens.device == torch.device(device):
            return self
        probs = None if self.draft_probs is None else self.draft_probs.to(device)
        return DraftTree(self.tokens.to(device), self.parents.to(device), probs)

    @property
    def num_nodes(self) -> int:
        """N, the number of draft tokens (the root not counted)."""
        return int(self.tokens.shape[0])

    @property
    def vocab_size(self) -> int | None:
        """V of `draft_probs`, or None when the draft has no probabilities."""
        return None if self.draft_probs is None else int(self.draft_probs.shape[1])

    def children(self) -> list[list[int]]:
        """`children()[i]` lists the nodes whose parent is i (i = 0..N), in increasing order."""
        out: list[list[int]] = [[] for _ in range(self.num_nodes + 1)]
        for node, parent in enumerate(self.parent_ids, start=1):
            out[parent].append(node)
        return out

    def paths(self) -> list[list[int]]:
        """Root-to-leaf node lists (root excluded), one per leaf, ordered by leaf index.

        The empty tree has one empty path: the root is its only leaf.
        """
        parents = [0, *self.parent_ids]
        children = self.children()
        out: list[list[int]] = []
        for leaf in range(self.num_nodes + 1):
            if children[leaf]:
                continue
            path: list[int] = []
            node = leaf
            while node != 0:
                path.append(node)
                node = parents[node]
            out.append(path[::-1])
        return out

    def ancestor_mask(self) -> Tensor:
        """Tree-attention mask among the new tokens: (N+1, N+1) bool.

        `[i, j]` is True iff forward index j is i itself or an ancestor of i (the root, index 0,
        is an ancestor of every node). Every index also attends to the whole KV cache; that part
        is not included here.
        """
        n = self.num_nodes
        # Laid out on the host, a row a node (its parent's row, which precedes it, plus itself),
        # and moved once: on a GPU each element set is a launch, on a CPU each small op ~µs.
        mask = np.eye(n + 1, dtype=bool)  # (N+1, N+1)
        for node, parent in enumerate(self.parent_ids, start=1):
            mask[node, :node] = mask[parent, :node]
        return torch.from_numpy(mask).to(self.parents.device)

    def depths(self) -> Tensor:
        """(N+1,) long: depth of every forward index, the root 0."""
        return torch.tensor(self.depth_ids, dtype=torch.long, device=self.parents.device)  # (N+1,)

    def graft(self, chain: Sequence[int]) -> DraftTree:
        """This tree plus the path `chain` from the root: the chain follows existing nodes while
        their tokens match, and the rest is appended after every existing node, so the existing
        nodes keep their numbers and the new ones are each tried after their existing siblings.
        New nodes are point masses: rows of `draft_probs` one-hot on their tokens.
        """
        tokens, parents = list(self.token_ids), list(self.parent_ids)
        children = self.children()
        at, k = 0, 0  # the node reached, the chain tokens matched
        while k < len(chain):
            same = [c for c in children[at] if tokens[c - 1] == chain[k]]
            if not same:
                break
            at, k = same[0], k + 1
        rest = [int(t) for t in chain[k:]]
        if not rest:
            return self
        for token in rest:
            parents.append(at)
            tokens.append(token)
            at = len(tokens)
        device = self.tokens.device
        probs = self.draft_probs
        if probs is not None:
            new = torch.zeros(len(rest), probs.shape[1], dtype=probs.dtype, device=probs.device)  # (M, V)
            new[torch.arange(len(rest)), torch.tensor(rest)] = 1.0
            probs = torch.cat([probs, new])
        return DraftTree(
            torch.tensor(tokens, dtype=torch.long, device=device),
            torch.tensor(parents, dtype=torch.long, device=device),
            probs,
        )

    @staticmethod
    def from_choices(choices: Sequence[Sequence[int]]) -> TreeShape:
        """Same as the module function `from_choices` (the Medusa tree shape, no tokens yet)."""
        return from_choices(choices)


@dataclass(frozen=True, eq=False)
class TreeShape:
    """The shape of a Medusa-style tree, before any token is known.

    Built by `from_choices`. For node i (1..N, forward numbering): `parents[i-1]` as in
    `DraftTree`; `depths[i-1]` >= 1; `topk[i-1]` is the rank of its token among the candidates
    proposed for depth `depths[i-1]` (Medusa head `depths[i-1] - 1`, 0 = most likely). `choices`
    holds each node's full index path, in node order.
    """

    parents: Tensor  # (N,) long
    depths: Tensor  # (N,) long
    topk: Tensor  # (N,) long
    choices: tuple[tuple[int, ...], ...]

    @property
    def num_nodes(self) -> int:
        """N, the number of draft nodes."""
        return int(self.parents.shape[0])

    def build(self, tokens: Tensor, draft_probs: Tensor | None = None) -> DraftTree:
        """The `DraftTree` with this shape and the given node tokens.

        `tokens` is (N,) long; typically `topk_tokens[depths - 1, topk]` where `topk_tokens` is
        (D, K) holding the K best tokens of each of the D heads.
        """
        parents = self.parents.to(tokens.device)  # (N,)
        return DraftTree(tokens, parents, draft_probs)


def from_choices(choices: Sequence[Sequence[int]]) -> TreeShape:
    """Build the tree shape described by Medusa-style `medusa_choices`.

    Each choice is a path of top-k ranks: `[1, 0]` is "the second candidate at depth 1, then the
    first candidate at depth 2 after it". Both the "all candidates" form (every node listed) and
    the "leaf paths only" form are accepted and give identical trees: missing prefixes are added
    and duplicates dropped. Nodes are sorted by (depth, choice) so every parent precedes its
    children. An empty `choices` gives the empty tree.
    """
    nodes: set[tuple[int, ...]] = set()
    for choice in choices:
        path = tuple(choice)
        if not path:
            raise SpecDecodeError("a tree choice is empty; the root is implicit, list only draft nodes")
        if any(not isinstance(k, int) or isinstance(k, bool) or k < 0 for k in path):
            raise SpecDecodeError(f"tree choice {list(path)} must hold non-negative integer top-k ranks")
        for length in range(1, len(path) + 1):
            nodes.add(path[:length])
    ordered = sorted(nodes, key=lambda p: (len(p), p))
    index = {path: i for i, path in enumerate(ordered, start=1)}
    parents = [index[p[:-1]] if len(p) > 1 else 0 for p in ordered]
    return TreeShape(
        parents=torch.tensor(parents, dtype=torch.long),  # (N,)
        depths=torch.tensor([len(p) for p in ordered], dtype=torch.long),  # (N,)
        topk=torch.tensor([p[-1] for p in ordered], dtype=torch.long),  # (N,)
        choices=tuple(ordered),
    )
