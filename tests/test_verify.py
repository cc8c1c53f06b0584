"""Greedy and lossless-sampling verification of draft trees.

The sampling tests are statistical. A toy "target model" and "draft model" map a token prefix to
a distribution over a small vocabulary. Each trial draws a fresh draft tree (tokens sampled from
the draft where the tree has probabilities), verifies it, and records the emitted tokens. A
verifier is lossless iff, for every prefix s that it extends, the next emitted token is
distributed as target(s): the emitted prefix before the last token is always an accepted tree
path, and whether a token is followed by another one is decided by the tokens themselves (a
recovered token never equals a rejected sibling's token). So `check_lossless` compares, for each
prefix seen often enough, the empirical next-token distribution with target(prefix) by a
chi-square test and a total-variation bound derived from the sample count.
"""

from __future__ import annotations

import functools
import itertools
import random
import zlib
from bisect import bisect_right
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from specdecode.tree import DraftTree
from specdecode.verify import Verdict, _residual, verify_greedy, verify_sampling
from tests.stats import DistributionCheck, chi_square_sf

V = 8  # vocabulary of the toy models
MIN_COUNT = 400  # prefixes reached fewer times are not tested (expected counts too small)

Verifier = Callable[[DraftTree, Tensor, torch.Generator], Verdict]


# ------------------------------------------------------------------------------------------------
# Toy models: deterministic functions of the prefix, so rows for equal prefixes are equal.


def _toy_row(prefix: tuple[int, ...], salt: str, scale: float) -> Tensor:  # (V,) float64
    g = torch.Generator().manual_seed(zlib.crc32(f"{salt}{prefix}".encode()))
    return torch.softmax(scale * torch.randn(V, generator=g, dtype=torch.float64), dim=0)


@functools.cache
def target_row(prefix: tuple[int, ...]) -> Tensor:  # (V,) float64
    return _toy_row(prefix, "target", 1.3)


@functools.cache
def draft_row(prefix: tuple[int, ...]) -> Tensor:  # (V,) float64
    # Related to the target but different (a draft model that is often, not always, right).
    return 0.5 * _toy_row(prefix, "target", 1.3) + 0.5 * _toy_row(prefix, "draft", 1.3)


@functools.cache
def _draft_cdf(prefix: tuple[int, ...]) -> list[float]:
    return draft_row(prefix).cumsum(0).tolist()


@dataclass(frozen=True)
class Case:
    """A tree shape plus either fixed tokens (point-mass draft) or None (tokens drawn i.i.d.

    from the draft model at their parent's prefix, so siblings are independent draws from one q).
    """

    name: str
    parents: list[int]
    tokens: list[int] | None = None


def draw_trial(case: Case, rng: random.Random) -> tuple[DraftTree, Tensor]:
    """One draft tree and its target rows: ((N nodes), (N+1, V) float64)."""
    prefixes: list[tuple[int, ...]] = [()]  # token path of every forward index
    tokens: list[int] = []
    q_rows: list[Tensor] = []
    for node, parent in enumerate(case.parents, start=1):
        prefix = prefixes[parent]
        if case.tokens is not None:
            x = case.tokens[node - 1]
        else:
            x = min(bisect_right(_draft_cdf(prefix), rng.random()), V - 1)
            q_rows.append(draft_row(prefix))
        tokens.append(x)
        prefixes.append((*prefix, x))
    tree = DraftTree(
        torch.tensor(tokens, dtype=torch.long),
        torch.tensor(case.parents, dtype=torch.long),
        torch.stack(q_rows) if q_rows else None,
    )
    return tree, torch.stack([target_row(p) for p in prefixes])


@dataclass(frozen=True)
class PrefixCheck(DistributionCheck):
    """The check of the next token's distribution after `prefix`, reached `n` times."""

    prefix: tuple[int, ...] = ()


def chi_square_p_value(observed: Tensor, expected_probs: Tensor) -> float:
    """Goodness-of-fit p-value of counts (V,) against probabilities (V,)."""
    n = float(observed.sum())
    support = expected_probs > 0
    if bool((observed[~support] > 0).any()):
        return 0.0
    expected = n * expected_probs[support]
    stat = float(((observed[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    return chi_square_sf(stat, dof)


def check_lossless(verifier: Verifier, case: Case, n: int, seed: int) -> list[PrefixCheck]:
    """Run `n` trials; compare each well-visited prefix's next-token law with the target's."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    nexts: dict[tuple[int, ...], Counter[int]] = defaultdict(Counter)
    for _ in range(n):
        tree, probs = draw_trial(case, rng)
        out = verifier(tree, probs, gen).tokens
        for j, token in enumerate(out):
            nexts[tuple(out[:j])][token] += 1
    report = []
    for prefix, counter in sorted(nexts.items()):
        count = sum(counter.values())
        if count < MIN_COUNT:
            continue
        observed = torch.tensor([counter[t] for t in range(V)], dtype=torch.float64)
        expected = target_row(prefix)
        tv = 0.5 * float((observed / count - expected).abs().sum())
        p_value = chi_square_p_value(observed, expected)
        report.append(PrefixCheck(count, p_value, tv, tv_bound=3 * (V / count) ** 0.5, prefix=prefix))
    return report


def looks_lossless(report: list[PrefixCheck]) -> bool:
    return all(check.ok for check in report)


# ------------------------------------------------------------------------------------------------
# A textbook re-implementation with switchable bugs, to prove the check has teeth.


def textbook_verifier(
    *, recover_from_target: bool = False, residual_between_siblings: bool = True
) -> Verifier:
    """Speculative sampling written plainly; each flag plants a known bug when changed."""

    def verify(tree: DraftTree, target_probs: Tensor, generator: torch.Generator) -> Verdict:
        children = tree.children()
        draft = tree.tokens.tolist()
        accepted: list[int] = []
        node = 0
        while True:
            p = target_probs[node]  # (V,)
            for child in children[node]:
                x = draft[child - 1]
                if tree.draft_probs is None:
                    q = torch.zeros_like(p)
                    q[x] = 1.0
                else:
                    q = tree.draft_probs[child - 1]  # (V,)
                if float(torch.rand((), generator=generator, dtype=torch.float64)) < min(1.0, p[x] / q[x]):
                    accepted.append(child)
                    node = child
                    break
                if residual_between_siblings:
                    p = (p - q).clamp(min=0)
                    p = p / p.sum()
            else:
                final = target_probs[node] if recover_from_target else p
                last = int(torch.multinomial(final, 1, generator=generator))
                return Verdict(accepted, [draft[c - 1] for c in accepted] + [last])

    return verify


# ------------------------------------------------------------------------------------------------
# Greedy


def _peaked_logits(argmaxes: list[int], vocab: int = 16) -> Tensor:  # (len(argmaxes), vocab)
    logits = torch.zeros(len(argmaxes), vocab)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


# The hand tree of test_tree.py: 1[10] and 2[11] under the root; 3[12], 4[13] under 1; 5[14]
# under 3; 6[15] under 2.
HAND = DraftTree(torch.tensor([10, 11, 12, 13, 14, 15]), torch.tensor([0, 0, 1, 1, 3, 2]))


@pytest.mark.parametrize(
    ("argmaxes", "accepted", "tokens"),
    [
        pytest.param([10, 12, 0, 14, 0, 7, 0], [1, 3, 5], [10, 12, 14, 7], id="full-accept-bonus"),
        pytest.param([9, 12, 15, 14, 0, 7, 3], [], [9], id="reject-at-first"),
        pytest.param([11, 12, 15, 14, 0, 7, 3], [2, 6], [11, 15, 3], id="second-sibling-branch"),
        pytest.param([10, 13, 0, 14, 5, 7, 0], [1, 4], [10, 13, 5], id="second-child-then-bonus"),
        pytest.param([10, 12, 0, 2, 0, 7, 0], [1, 3], [10, 12, 2], id="accept-then-correct"),
    ],
)
def test_verify_greedy_hand_tree(argmaxes: list[int], accepted: list[int], tokens: list[int]) -> None:
    verdict = verify_greedy(HAND, _peaked_logits(argmaxes))
    assert verdict.accepted_nodes == accepted
    assert verdict.tokens == tokens
    assert verdict.num_draft_accepted == len(accepted)
    assert verdict.kept_indices == [0, *accepted]


def test_verify_greedy_empty_tree_is_plain_decoding() -> None:
    logits = torch.randn(1, 50)
    verdict = verify_greedy(DraftTree.empty(), logits)
    assert verdict.accepted_nodes == []
    assert verdict.tokens == [int(logits[0].argmax())]


def test_verify_greedy_ties_follow_torch_argmax() -> None:
    logits = torch.zeros(2, 8)
    logits[0, 3] = logits[0, 5] = 2.0  # tie between 3 and 5: argmax gives the first
    tree = DraftTree.chain([5])
    verdict = verify_greedy(tree, logits)
    assert verdict.tokens == [int(torch.argmax(logits[0]))] == [3]


def test_verify_greedy_reproduces_plain_greedy_decoding() -> None:
    """Random trees against the toy target: the output is a prefix of plain greedy decoding."""
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randrange(0, 9)
        parents = [rng.randrange(0, i) for i in range(1, n + 1)]
        prefixes: list[tuple[int, ...]] = [()]
        tokens = []
        for parent in parents:
            # Half the time propose the target's own choice, so that long acceptances happen.
            best = int(target_row(prefixes[parent]).argmax())
            x = best if rng.random() < 0.5 else rng.randrange(V)
            tokens.append(x)
            prefixes.append((*prefixes[parent], x))
        tree = DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))
        logits = torch.stack([target_row(p).log() for p in prefixes])
        verdict = verify_greedy(tree, logits)
        plain: list[int] = []
        for _ in verdict.tokens:
            plain.append(int(target_row(tuple(plain)).argmax()))
        assert verdict.tokens == plain
        assert [tokens[c - 1] for c in verdict.accepted_nodes] == verdict.tokens[:-1]
        # The accepted nodes form a root-to-node path.
        for a, b in itertools.pairwise([0, *verdict.accepted_nodes]):
            assert parents[b - 1] == a


def test_verify_greedy_shape_errors() -> None:
    with pytest.raises(ValueError, match="N\\+1=3"):
        verify_greedy(DraftTree.chain([1, 2]), torch.zeros(2, 8))
    with pytest.raises(ValueError, match="vocabulary size"):
        verify_greedy(DraftTree.chain([1], torch.full((1, 4), 0.25)), torch.zeros(2, 8))


# ------------------------------------------------------------------------------------------------
# Sampling: deterministic corner cases


def test_verify_sampling_certain_accept_and_reject() -> None:
    tree = DraftTree.chain([1, 2, 3])
    probs = torch.zeros(4, V, dtype=torch.float64)
    probs[0, 1] = probs[1, 2] = probs[2, 3] = probs[3, 6] = 1.0  # the target agrees, then says 6
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        verdict = verify_sampling(tree, probs, gen)
        assert verdict.accepted_nodes == [1, 2, 3]
        assert verdict.tokens == [1, 2, 3, 6]
    # p(x) = 0 for every root child: always rejected, recovered token never one of them.
    siblings = DraftTree(torch.tensor([0, 0, 1]), torch.tensor([0, 0, 0]))
    probs = torch.full((4, V), 1.0 / V, dtype=torch.float64)
    probs[0, :2] = 0.0
    probs[0] /= probs[0].sum()
    for _ in range(50):
        verdict = verify_sampling(siblings, probs, gen)
        assert verdict.accepted_nodes == []
        assert verdict.tokens[0] >= 2


def test_verify_sampling_is_reproducible_with_a_seeded_generator() -> None:
    tree, probs = draw_trial(Case("deep", [0, 0, 1, 1, 2, 3]), random.Random(1))
    a = [verify_sampling(tree, probs, torch.Generator().manual_seed(7)).tokens for _ in range(3)]
    assert a[0] == a[1] == a[2]


def test_verify_sampling_errors() -> None:
    with pytest.raises(ValueError, match="N\\+1=2"):
        verify_sampling(DraftTree.chain([1]), torch.full((3, V), 1.0 / V))
    with pytest.raises(ValueError, match="vocabulary size"):
        verify_sampling(DraftTree.chain([1], torch.full((1, 4), 0.25)), torch.full((2, V), 1.0 / V))
    with pytest.raises(ValueError, match="target vocabulary"):
        verify_sampling(DraftTree.chain([V]), torch.full((2, V), 1.0 / V))


def test_residual_rule_and_fallback() -> None:
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.6, 0.2], dtype=torch.float64)
    assert torch.allclose(_residual(p, 1, q), torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    assert torch.allclose(_residual(p, 0, None), torch.tensor([0.0, 0.6, 0.4], dtype=torch.float64))
    # p == q leaves no residual mass (a rejection that exact arithmetic rules out): fall back to p.
    assert torch.equal(_residual(p, 0, p.clone()), p)
    assert torch.equal(_residual(torch.tensor([0.0, 1.0, 0.0]), 1, None), torch.tensor([0.0, 1.0, 0.0]))


# ------------------------------------------------------------------------------------------------
# Sampling: statistical losslessness

CASES = [
    # (case, trials)
    (Case("empty", []), 20_000),
    (Case("chain-with-probs", [0, 1, 2]), 30_000),
    # Point-mass chain: tokens the toy target likes, so the deep prefixes get visited.
    (Case("chain-point-mass", [0, 1, 2], tokens=[4, 6, 5]), 30_000),
    (Case("root-siblings-iid", [0, 0, 0]), 30_000),
    (Case("point-mass-siblings-with-duplicates", [0, 0, 0, 0, 1, 3], tokens=[4, 4, 1, 5, 6, 2]), 30_000),
    (Case("deeper-tree-with-probs", [0, 0, 1, 1, 2, 3, 6]), 30_000),
]


@pytest.mark.parametrize(("case", "trials"), CASES, ids=[c.name for c, _ in CASES])
def test_verify_sampling_is_lossless(case: Case, trials: int) -> None:
    report = check_lossless(verify_sampling, case, trials, seed=1234)
    assert looks_lossless(report), [c for c in report if not c.ok]
    # The first token is always tested; the trees are shaped so that some deeper prefix is too.
    assert report[0].prefix == () and report[0].n == trials
    if case.parents:
        assert any(len(c.prefix) >= 1 for c in report)


def test_prefix_checks_reach_depth() -> None:
    """The chain cases really test 2-token (and deeper) joint laws, not only the first token."""
    report = check_lossless(verify_sampling, CASES[2][0], 5_000, seed=5)
    assert {len(c.prefix) for c in report} >= {0, 1, 2}


@pytest.mark.parametrize(
    ("verifier", "case", "should_pass"),
    [
        pytest.param(textbook_verifier(), CASES[1][0], True, id="textbook-control"),
        pytest.param(textbook_verifier(recover_from_target=True), CASES[1][0], False, id="recover-from-p"),
        pytest.param(
            textbook_verifier(recover_from_target=True), CASES[2][0], False, id="recover-from-p-point-mass"
        ),
        pytest.param(
            textbook_verifier(residual_between_siblings=False), CASES[4][0], False, id="no-sibling-residual"
        ),
        pytest.param(
            textbook_verifier(residual_between_siblings=False),
            CASES[3][0],
            False,
            id="no-sibling-residual-iid",
        ),
    ],
)
def test_check_flags_broken_verifiers(verifier: Verifier, case: Case, should_pass: bool) -> None:
    report = check_lossless(verifier, case, 15_000, seed=99)
    assert looks_lossless(report) is should_pass, report
