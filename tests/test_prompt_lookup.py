"""Prompt lookup: the search itself (table-driven, against a brute-force reference, fast on long
sequences), its fallback wiring, and greedy losslessness through the engine."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import cast

import pytest
import torch

from specdecode.drafters.base import Drafter, Proposal, StepResult
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.models.transformer import Transformer
from specdecode.request import Request
from specdecode.sampling import SamplingParams
from specdecode.spec_config import PromptLookupConfig
from specdecode.tree import DraftTree
from tests.alone import alone
from tests.tiny import load_tiny_hf

pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass
class FakeRequest:
    """The two fields prompt lookup reads from a `Request`."""

    all_ids: list[int]
    max_len: int = 10_000


def fake(ids: list[int], max_len: int = 10_000) -> Request:
    return cast(Request, FakeRequest(ids, max_len))


def lookup(ids: list[int], ngram: int, k: int, max_len: int = 10_000) -> list[int]:
    drafter = PromptLookupDrafter(
        PromptLookupConfig(prompt_lookup_num_tokens=k, max_matching_ngram_size=ngram)
    )
    tree = drafter.propose(fake(ids, max_len)).tree
    assert tree.draft_probs is None  # point masses
    assert tree.parents.tolist() == list(range(tree.num_nodes))  # a chain
    return tree.tokens.tolist()


def reference_lookup(ids: list[int], ngram: int, k: int, max_len: int = 10_000) -> list[int]:
    """The definition, by brute force: longest n first, most recent earlier occurrence."""
    k = min(k, max_len - len(ids))
    if k <= 0:
        return []
    for n in range(min(ngram, len(ids) - 1), 0, -1):
        suffix = ids[len(ids) - n :]
        for end in range(len(ids) - 1, n - 1, -1):
            if ids[end - n : end] == suffix:
                return ids[end : end + k]
    return []


# (ids, max n-gram, k, max_len, expected draft)
CASES: dict[str, tuple[list[int], int, int, int, list[int]]] = {
    # [1 2 3] last followed by 9 8; the more recent bigram [2 3] by 7 6: the longer match wins.
    "longest n-gram first": ([1, 2, 3, 9, 8, 5, 2, 3, 7, 6, 1, 2, 3], 3, 2, 10_000, [9, 8]),
    "bigram when trigrams are off": ([1, 2, 3, 9, 8, 5, 2, 3, 7, 6, 1, 2, 3], 2, 2, 10_000, [7, 6]),
    "unigram when no bigram matches": ([4, 9, 8, 7, 5, 4], 2, 3, 10_000, [9, 8, 7]),
    "most recent occurrence": ([4, 5, 1, 0, 4, 5, 2, 0, 4, 5], 2, 2, 10_000, [2, 0]),
    "fewer than k tokens at the end": ([7, 8, 9, 7, 8], 2, 5, 10_000, [9, 7, 8]),
    "overlapping run": ([3, 3, 3], 2, 4, 10_000, [3]),
    "no match": ([1, 2, 3, 4], 3, 4, 10_000, []),
    "single token": ([5], 2, 4, 10_000, []),
    "room limits the draft": ([1, 2, 3, 1, 2], 2, 4, 7, [3, 1]),
    "no room, no draft": ([1, 2, 3, 1, 2], 2, 4, 5, []),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_lookup_table(case: tuple[list[int], int, int, int, list[int]]) -> None:
    ids, ngram, k, max_len, expected = case
    assert lookup(ids, ngram, k, max_len) == expected
    assert reference_lookup(ids, ngram, k, max_len) == expected


def test_incremental_index_matches_brute_force() -> None:
    """Grow sequences token by token (with repeats, as generation does) and compare every step."""
    rng = random.Random(0)
    for trial in range(30):
        ngram, k = rng.randint(1, 4), rng.randint(1, 6)
        drafter = PromptLookupDrafter(
            PromptLookupConfig(prompt_lookup_num_tokens=k, max_matching_ngram_size=ngram)
        )
        ids = [rng.randrange(5) for _ in range(rng.randint(1, 8))]
        for _ in range(120):
            max_len = rng.choice([len(ids) + 2, 10_000])
            got = drafter.propose(fake(list(ids), max_len)).tree.tokens.tolist()
            assert got == reference_lookup(ids, ngram, k, max_len), (trial, ids)
            ids += [rng.randrange(5) for _ in range(rng.randint(1, 3))]


def test_lookup_is_fast_on_long_sequences() -> None:
    """Thousands of tokens, one propose per step: per-step cost must not grow with the length."""
    rng = random.Random(1)
    drafter = PromptLookupDrafter(PromptLookupConfig(prompt_lookup_num_tokens=8, max_matching_ngram_size=4))
    ids = [rng.randrange(500) for _ in range(4000)]
    drafter.propose(fake(ids))  # indexes the prompt once
    t0 = time.perf_counter()
    for _ in range(2000):
        ids += [rng.randrange(500) for _ in range(3)]
        drafter.propose(fake(ids))
    per_step = (time.perf_counter() - t0) / 2000
    assert per_step < 1e-3, f"{per_step * 1e6:.0f} us per step"


@dataclass
class RecordingDrafter(Drafter):
    """A fallback that proposes a fixed chain and records what it was told."""

    max_nodes: int = 6
    calls: list[str] = field(default_factory=list)

    def begin(self, req: Request, prompt_hidden: torch.Tensor | None) -> None:
        self.calls.append("begin")

    def propose(self, req: Request, budget: int | None = None) -> Proposal:
        self.calls.append("propose")
        return Proposal(DraftTree.chain([42, 43]))

    def observe(self, req: Request, result: StepResult) -> None:
        self.calls.append("observe")


def test_fallback_only_when_nothing_matches() -> None:
    fallback = RecordingDrafter()
    drafter = PromptLookupDrafter(PromptLookupConfig(prompt_lookup_num_tokens=3), fallback)
    assert drafter.max_nodes == 6  # the larger of lookup's 3 and the fallback's 6
    assert PromptLookupDrafter(PromptLookupConfig(prompt_lookup_num_tokens=7), fallback).max_nodes == 7
    assert PromptLookupDrafter(PromptLookupConfig(prompt_lookup_num_tokens=3)).max_nodes == 3

    drafter.begin(fake([1, 2, 3, 4]), None)
    no_match = drafter.propose(fake([1, 2, 3, 4]))
    assert no_match.tree.tokens.tolist() == [42, 43] and drafter.last_source == "fallback"
    drafter.observe(fake([1, 2, 3, 4, 5]), cast(StepResult, None))
    match = drafter.propose(fake([1, 2, 3, 4, 5, 1, 2]))
    assert match.tree.tokens.tolist() == [3, 4, 5] and drafter.last_source == "lookup"
    drafter.observe(fake([1, 2, 3, 4, 5, 1, 2, 3]), cast(StepResult, None))
    # begin and every observe reach the fallback, propose only when lookup found nothing.
    assert fallback.calls == ["begin", "propose", "observe", "observe"]


@pytest.mark.parametrize(
    ("ids", "length"),
    [
        ([1, 2, 3], 0),  # nothing earlier ends with 3
        ([5, 1, 9, 8, 1], 1),  # "1" matched, what came before differs (5 vs 8)
        ([5, 1, 2, 9, 7, 1, 2], 2),
        ([4, 1, 2, 9, 4, 1, 2], 3),  # the 2-gram's occurrence shares one more token back
        ([3, 4, 1, 2, 9, 3, 4, 1, 2], 4),  # four or more: one way
        ([7, 3, 4, 1, 2, 9, 7, 3, 4, 1, 2], 4),
        ([1, 1, 1], 2),  # the occurrence overlaps the suffix: as far back as the text goes
    ],
)
def test_match_length_names_the_way(ids: list[int], length: int) -> None:
    """A copy is surer the more of the text's end its occurrence shares: the load policy keeps
    acceptance counts per match length (1, 2, 3, 4 or more), and the fallback apart."""
    drafter = PromptLookupDrafter(PromptLookupConfig(max_matching_ngram_size=2))
    assert drafter.match_length(ids) == length
    assert drafter.source(fake(ids)) == (f"lookup:{length}")
    # the load policy grants a copy after a match of 1-3 tokens at most that many (`copy_limit`)
    assert drafter.way_limit(drafter.source(fake(ids))) == (length if 0 < length < 4 else None)
    with_fallback = PromptLookupDrafter(PromptLookupConfig(), RecordingDrafter())
    assert with_fallback.source(fake(ids)) == (f"lookup:{length}" if length else "fallback")


def test_no_match_without_fallback_is_a_plain_step() -> None:
    drafter = PromptLookupDrafter(PromptLookupConfig())
    proposal = drafter.propose(fake([1, 2, 3]))
    assert proposal.tree.num_nodes == 0 and drafter.last_source == "none"


# ------------------------------------------------------------------------------------------------
# Through the engine: greedy output must equal plain greedy decoding token for token.


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Transformer:
    return load_tiny_hf(tmp_path_factory.mktemp("pl_target"))


@pytest.fixture(scope="module")
def draft(tmp_path_factory: pytest.TempPathFactory) -> Transformer:
    return load_tiny_hf(tmp_path_factory.mktemp("pl_draft"), seed=1)


def generate(model: Transformer, prompt: list[int], drafter: Drafter | None, max_tokens: int = 64) -> Request:
    req, steps = alone(
        model, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), [], drafter
    )
    for _ in steps:
        pass
    return req


PROMPTS = {
    "repetitive": [10, 11, 12, 13, 14, 15] * 5,
    "mixed": [5, 6, 7, 40, 41, 5, 6, 7, 90, 3, 5, 6],
    "no repeats": list(range(20, 50)),
}


@pytest.mark.parametrize("prompt", PROMPTS.values(), ids=PROMPTS.keys())
@pytest.mark.parametrize("ngram,k", [(1, 2), (2, 4), (3, 8)])
def test_greedy_lookup_equals_plain_greedy(
    target: Transformer, prompt: list[int], ngram: int, k: int
) -> None:
    plain = generate(target, prompt, None)
    config = PromptLookupConfig(prompt_lookup_num_tokens=k, max_matching_ngram_size=ngram)
    spec = generate(target, prompt, PromptLookupDrafter(config))
    assert spec.output_ids == plain.output_ids
    assert len(spec.output_ids) == 64


@pytest.mark.parametrize("prompt,min_tau", [([50] * 12, 1.9), ([65] * 12, 1.3)])
def test_lookup_speeds_up_a_repetitive_prompt(target: Transformer, prompt: list[int], min_tau: float) -> None:
    """On these prompts the random tiny target falls into runs of one token (50 50 50 ...; 73 73
    ..., 27 27 ...), lookup's best case: τ must exceed 1. (A run of period 1 yields one draft
    token per step: its most recent earlier occurrence ends one token before the end.)"""
    config = PromptLookupConfig(prompt_lookup_num_tokens=4, max_matching_ngram_size=2)
    spec = generate(target, prompt, PromptLookupDrafter(config), max_tokens=100)
    assert spec.output_ids == generate(target, prompt, None, max_tokens=100).output_ids
    assert spec.stats.mean_accepted_length > min_tau, spec.stats.as_dict()


@pytest.mark.parametrize("prompt", PROMPTS.values(), ids=PROMPTS.keys())
def test_greedy_lookup_with_draft_model_fallback(
    target: Transformer, draft: Transformer, prompt: list[int]
) -> None:
    config = PromptLookupConfig(prompt_lookup_num_tokens=3, max_matching_ngram_size=2, num_draft_tokens=4)
    fallback = DraftModelDrafter(config, draft, target.config.vocab_size)
    drafter = PromptLookupDrafter(config, fallback)
    sources: list[str] = []
    real_propose = drafter.propose

    def propose(req: Request, budget: int | None = None) -> Proposal:
        proposal = real_propose(req, budget)
        sources.append(drafter.last_source)
        return proposal

    drafter.propose = propose  # type: ignore[method-assign]
    prompt = [*prompt, 95]  # a token not seen before: lookup cannot draft the first step
    spec = generate(target, prompt, drafter)
    assert spec.output_ids == generate(target, prompt, None).output_ids
    assert sources[0] == "fallback"


def test_greedy_lookup_with_the_target_as_fallback_accepts_everything(target: Transformer) -> None:
    """The fallback's cache stays in step across lookup steps: with the target as its own draft,
    every fallback step is fully accepted."""
    config = PromptLookupConfig(prompt_lookup_num_tokens=2, max_matching_ngram_size=1, num_draft_tokens=3)
    drafter = PromptLookupDrafter(config, DraftModelDrafter(config, target, target.config.vocab_size))
    prompt = [*PROMPTS["mixed"], 95]
    req, run = alone(
        target, prompt, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True), [], drafter
    )
    steps: list[tuple[str, int]] = []
    for tokens in run:
        steps.append((drafter.last_source, len(tokens)))
    assert req.output_ids == generate(target, prompt, None, max_tokens=60).output_ids
    fallback_steps = [n for source, n in steps[:-1] if source == "fallback"]
    assert fallback_steps and all(n == 4 for n in fallback_steps), steps
    assert any(source == "lookup" for source, _ in steps), steps


def test_candidates_are_distinct_continuations_longest_ngram_first() -> None:
    from specdecode.drafters.prompt_lookup import PromptLookupDrafter, candidate_tree
    from specdecode.spec_config import PromptLookupConfig

    drafter = PromptLookupDrafter(
        PromptLookupConfig(prompt_lookup_num_tokens=4, max_matching_ngram_size=2, num_candidates=3)
    )
    #        0  1  2  3  4  5  6  7  8  9 10 11 12 13
    ids = [7, 1, 2, 3, 9, 1, 2, 5, 6, 8, 2, 4, 1, 2]
    # suffix bigram (1, 2) occurred ending at 7 (-> 5 6 8 2) and at 3 (-> 3 9 1 2); unigram (2,)
    # also at 11 (-> 4 1 2); candidates after the first are at most 4 // 2 = 2 tokens long
    assert drafter.lookup_candidates(ids, room=100) == [[5, 6, 8, 2], [3, 9], [4, 1]]
    assert drafter.lookup_candidates(ids, room=5) == [[5, 6, 8, 2], [3]]
    tree = candidate_tree([[5, 6, 8, 2], [3, 9], [4, 1]])
    assert tree.tokens.tolist() == [5, 6, 8, 2, 3, 9, 4, 1]
    assert tree.parents.tolist() == [0, 1, 2, 3, 0, 5, 0, 7]
    assert drafter.max_nodes == 4 + 2 * 2
