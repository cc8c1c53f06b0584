"""DraftTree structure helpers and the Medusa-choices tree shape."""

from __future__ import annotations

import pytest
import torch

from specdecode.errors import SpecDecodeError
from specdecode.tree import DraftTree, from_choices

# Hand-drawn tree (forward indices, token in brackets):
#
#   0 (root)
#   ├── 1 [10]
#   │   ├── 3 [12]
#   │   │   └── 5 [14]
#   │   └── 4 [13]
#   └── 2 [11]
#       └── 6 [15]
HAND_TOKENS = [10, 11, 12, 13, 14, 15]
HAND_PARENTS = [0, 0, 1, 1, 3, 2]


def hand_tree() -> DraftTree:
    return DraftTree(torch.tensor(HAND_TOKENS), torch.tensor(HAND_PARENTS))


@pytest.mark.parametrize(
    ("tokens", "parents", "draft_probs", "match"),
    [
        (torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), None, "1-D long"),
        (torch.tensor([1.0, 2.0]), torch.tensor([0, 1]), None, "1-D long"),
        (torch.tensor([1, 2]), torch.tensor([0]), None, "shaped like tokens"),
        (torch.tensor([1, 2]), torch.tensor([0, 1], dtype=torch.int32), None, "shaped like tokens"),
        (torch.tensor([1, -2]), torch.tensor([0, 1]), None, "non-negative"),
        (torch.tensor([1, 2]), torch.tensor([0, 2]), None, "topological"),  # node 2 is its own parent
        (torch.tensor([1, 2]), torch.tensor([1, 0]), None, "topological"),  # parent after child
        (torch.tensor([1, 2]), torch.tensor([0, -1]), None, "topological"),
        (torch.tensor([1, 2]), torch.tensor([0, 1]), torch.rand(3, 4), r"\(N=2, V\)"),
        (torch.tensor([1, 2]), torch.tensor([0, 1]), torch.rand(2), r"\(N=2, V\)"),
        (torch.tensor([1, 2]), torch.tensor([0, 1]), torch.ones(2, 4, dtype=torch.long), "float"),
        (torch.tensor([1, 5]), torch.tensor([0, 1]), torch.rand(2, 4), "vocabulary size 4"),
    ],
)
def test_draft_tree_validation(
    tokens: torch.Tensor, parents: torch.Tensor, draft_probs: torch.Tensor | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        DraftTree(tokens, parents, draft_probs)


def test_hand_tree_structure() -> None:
    tree = hand_tree()
    assert tree.num_nodes == 6
    assert tree.vocab_size is None
    assert tree.depths().tolist() == [0, 1, 1, 2, 2, 3, 2]
    ancestors = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 4}, 5: {0, 1, 3, 5}, 6: {0, 2, 6}}
    expected = torch.zeros(7, 7, dtype=torch.bool)
    for i, js in ancestors.items():
        expected[i, sorted(js)] = True
    mask = tree.ancestor_mask()
    assert mask.dtype == torch.bool
    assert torch.equal(mask, expected)
    assert tree.children() == [[1, 2], [3, 4], [6], [5], [], [], []]
    assert tree.paths() == [[1, 4], [1, 3, 5], [2, 6]]
    assert (tree.token_ids, tree.parent_ids, tree.depth_ids) == (
        HAND_TOKENS,
        HAND_PARENTS,
        tree.depths().tolist(),
    )


@pytest.mark.parametrize("seed", range(5))
def test_ancestor_mask_of_random_trees(seed: int) -> None:
    """The mask laid out from the host lists: [i, j] iff walking parents up from i reaches j."""
    g = torch.Generator().manual_seed(seed)
    n = 1 + seed * 9
    parents = [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n + 1)]
    tree = DraftTree(torch.randint(0, 50, (n,), generator=g), torch.tensor(parents))
    up = [0, *parents]
    expected = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    for i in range(n + 1):
        j = i
        expected[i, j] = True
        while j:
            j = up[j]
            expected[i, j] = True
    assert torch.equal(tree.ancestor_mask(), expected)
    assert tree.depth_ids == (expected.sum(1) - 1).tolist()
    assert tree.parent_ids == parents


@pytest.mark.parametrize("n", [0, 1, 5])
def test_chain(n: int) -> None:
    q = torch.full((n, 8), 1 / 8)
    tree = DraftTree.chain(list(range(n)), q)
    assert tree.parents.tolist() == list(range(n))
    assert tree.depths().tolist() == list(range(n + 1))
    assert torch.equal(tree.ancestor_mask(), torch.ones(n + 1, n + 1, dtype=torch.bool).tril())
    assert tree.paths() == [list(range(1, n + 1))]
    assert tree.vocab_size == 8


def test_empty() -> None:
    tree = DraftTree.empty()
    assert tree.num_nodes == 0
    assert tree.depths().tolist() == [0]
    assert tree.ancestor_mask().tolist() == [[True]]
    assert tree.children() == [[]]
    assert tree.paths() == [[]]


def test_chain_accepts_tensor_of_other_int_dtype() -> None:
    tree = DraftTree.chain(torch.tensor([3, 4], dtype=torch.int32))
    assert tree.tokens.dtype == torch.long
    assert tree.tokens.tolist() == [3, 4]


ALL_CANDIDATES = [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 1], [0, 1, 0], [1], [1, 0], [1, 1]]
PATHS_ONLY = [[0, 0, 0, 0], [0, 1, 0], [1, 0], [1, 1]]


@pytest.mark.parametrize(
    "choices", [ALL_CANDIDATES, PATHS_ONLY, PATHS_ONLY[::-1], ALL_CANDIDATES[::-1] + PATHS_ONLY]
)
def test_from_choices_forms_build_identical_trees(choices: list[list[int]]) -> None:
    shape = from_choices(choices)
    assert shape.num_nodes == 9
    # Sorted by (depth, choice): (0) (1) (0,0) (0,1) (1,0) (1,1) (0,0,0) (0,1,0) (0,0,0,0).
    assert shape.choices == (
        (0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0)
    )  # fmt: skip
    assert shape.parents.tolist() == [0, 0, 1, 1, 2, 2, 3, 4, 7]
    assert shape.depths.tolist() == [1, 1, 2, 2, 2, 2, 3, 3, 4]
    assert shape.topk.tolist() == [0, 1, 0, 1, 0, 1, 0, 0, 0]


def test_from_choices_shape_agrees_with_draft_tree() -> None:
    shape = DraftTree.from_choices(PATHS_ONLY)
    # Medusa-style filling: the K best tokens of each of the D heads, (D, K).
    topk_tokens = torch.tensor([[100, 101], [200, 201], [300, 301], [400, 401]])
    tree = shape.build(topk_tokens[shape.depths - 1, shape.topk])
    assert tree.tokens.tolist() == [100, 101, 200, 201, 200, 201, 300, 300, 400]
    assert torch.equal(tree.depths()[1:], shape.depths)
    assert tree.paths() == [[2, 5], [2, 6], [1, 4, 8], [1, 3, 7, 9]]
    leaf_choices = {shape.choices[path[-1] - 1] for path in tree.paths()}
    assert leaf_choices == {tuple(c) for c in PATHS_ONLY}


def test_from_choices_empty() -> None:
    shape = from_choices([])
    assert shape.num_nodes == 0
    assert shape.build(torch.zeros(0, dtype=torch.long)).num_nodes == 0


@pytest.mark.parametrize("choices", [[[]], [[0], [-1]], [[0, 1.5]], [[True]]])
def test_from_choices_rejects_bad_input(choices: list[list[int]]) -> None:
    with pytest.raises(SpecDecodeError):
        from_choices(choices)
