"""Lookahead decoding: greedy output identical to plain decoding, n-gram pool and window mask
semantics, the per-step token budget, and an exact sampling-distribution check.

The sampling check runs the whole engine (drafter + one forward + `verify_sampling`) many times
on a 1-layer model with a 12-token vocabulary and compares the empirical law of the 3 generated
tokens with the exact law enumerated from the target's probabilities. The same check is shown to
catch a verifier that accepts drafts without testing them, and one that recovers from the target
row instead of the residual.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from specdecode.drafters.base import Proposal, SamplingVerifier, StepResult
from specdecode.drafters.lookahead import (
    LookaheadDrafter,
    NgramPool,
    ngram_tree,
    window_layout,
)
from specdecode.engine.config import EngineConfig
from specdecode.engine.drafter_factory import DrafterFactory
from specdecode.engine.llm_engine import EngineRequest, LLMEngine
from specdecode.models.transformer import Transformer
from specdecode.request import Request
from specdecode.sampling import SamplingParams, logits_to_probs
from specdecode.spec_config import LookaheadConfig
from specdecode.tree import DraftTree
from specdecode.verify import Verdict
from tests.alone import alone, prefill
from tests.stats import chi_square_sf
from tests.tiny import hf_sizes, load_tiny_hf

PROMPTS = [
    [1, 5, 9, 13, 20],
    [1, 40, 41, 42, 43, 40, 41, 42, 43],
    list(range(3, 30)),
    [1, 7, 7, 7, 60, 61, 7, 7, 7, 60],
]
CONFIGS = [(1, 1, 0), (2, 2, 1), (4, 3, 4), (5, 4, 3), (1, 3, 2), (3, 3, 0), (2, 5, 2)]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _run(
    model: Transformer, prompt: list[int], params: SamplingParams, drafter: LookaheadDrafter | None = None
) -> Request:
    req, steps = alone(model, prompt, params, [2], drafter)
    for _ in steps:
        pass
    return req


class RecordingDrafter(LookaheadDrafter):
    """Keeps every proposal and step result, to check budgets and mask semantics afterwards."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[tuple[list[int], int, Proposal]] = []  # (all_ids, cache length, proposal)
        self.results: list[StepResult] = []

    def propose(self, req: Request, budget: int | None = None) -> Proposal:
        proposal = super().propose(req, budget)
        self.steps.append((req.all_ids, req.cache.length, proposal))
        return proposal

    def observe(self, req: Request, result: StepResult) -> None:
        self.results.append(result)
        super().observe(req, result)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> Transformer:
    return Transformer.from_dir(tiny_model_dir)


# ------------------------------------------------------------------------------------------------
# Greedy losslessness


@pytest.mark.parametrize("wng", CONFIGS, ids=[str(c) for c in CONFIGS])
def test_greedy_output_equals_plain_decoding(tiny: Transformer, wng: tuple[int, int, int]) -> None:
    config = LookaheadConfig(*wng)
    for prompt in PROMPTS:
        plain = _run(tiny, prompt, _greedy(64))
        drafter = RecordingDrafter(config)
        spec = _run(tiny, prompt, _greedy(64), drafter)
        assert spec.output_ids == plain.output_ids, (wng, prompt)
        assert len(spec.output_ids) == 64
        # The per-step budget: tree nodes + side tokens never exceed max_draft_len, which is
        # exactly what the drafter announces to size the cache.
        assert drafter.max_nodes == (0 if config.is_plain else config.max_draft_len)
        for _, _, proposal in drafter.steps:
            assert proposal.tree.num_nodes + proposal.num_side <= drafter.max_nodes
        if config.is_plain:
            assert spec.stats.num_draft_tokens == 0
            assert DrafterFactory(tiny).build(config) is None  # (1, 1, 0) builds no drafter


@pytest.mark.parametrize(("context_ngrams", "realign"), [(False, False), (False, True), (True, True)])
def test_greedy_lossless_for_every_variant(tiny: Transformer, context_ngrams: bool, realign: bool) -> None:
    for prompt in PROMPTS[:2]:
        plain = _run(tiny, prompt, _greedy(60))
        drafter = LookaheadDrafter(LookaheadConfig(4, 4, 3), context_ngrams=context_ngrams, realign=realign)
        assert _run(tiny, prompt, _greedy(60), drafter).output_ids == plain.output_ids


def test_side_tokens_dropped_near_the_context_limit(tiny: Transformer) -> None:
    """With the cache capped by the model's context, the drafter shrinks its proposal instead of
    overflowing it, and the output is still plain greedy decoding's."""
    context = tiny.config.max_position_embeddings
    prompt = [(7 * i) % 90 + 3 for i in range(context - 12)]
    plain = _run(tiny, prompt, _greedy(50))
    drafter = RecordingDrafter(LookaheadConfig(5, 4, 3))
    spec = _run(tiny, prompt, _greedy(50), drafter)
    assert spec.output_ids == plain.output_ids
    assert len(spec.output_ids) == context - len(prompt)
    for _, cache_len, proposal in drafter.steps:
        assert cache_len + 1 + proposal.tree.num_nodes + proposal.num_side <= spec.max_len


@pytest.mark.parametrize("context_ngrams", [False, True])
def test_periodic_output_gets_pool_hits(tiny_model_dir: Path, context_ngrams: bool) -> None:
    """The tiny Llama (seed 0) falls into repeating token 1 after this prompt: the Jacobi window
    alone (no context n-grams) then produces n-grams the target accepts, so τ > 1."""
    if "llama" not in tiny_model_dir.name:
        pytest.skip("the periodic case was found on the tiny Llama")
    model = Transformer.from_dir(tiny_model_dir)
    prompt = [1, 23, 23, 23, 23]
    plain = _run(model, prompt, _greedy(80))
    assert plain.output_ids[-20:] == [1] * 20
    drafter = LookaheadDrafter(LookaheadConfig(4, 4, 4), context_ngrams=context_ngrams)
    spec = _run(model, prompt, _greedy(80), drafter)
    assert spec.output_ids == plain.output_ids
    assert spec.stats.mean_accepted_length > 1.5
    assert spec.stats.num_accepted_tokens > 0


# ------------------------------------------------------------------------------------------------
# Pool and tree


def test_pool_keeps_most_recent_first_without_duplicates() -> None:
    pool = NgramPool(capacity=2)
    pool.add(5, (1, 2))
    pool.add(5, (3, 4))
    assert pool.get(5) == [(3, 4), (1, 2)]
    pool.add(5, (1, 2))  # a repeat moves to the front instead of being stored twice
    assert pool.get(5) == [(1, 2), (3, 4)]
    pool.add(5, (7, 8))  # over capacity: the oldest goes
    assert pool.get(5) == [(7, 8), (1, 2)]
    assert pool.get(6) == [] and 6 not in pool and 5 in pool
    assert len(pool) == 2
    empty = NgramPool(capacity=0)
    empty.add(5, (1, 2))
    assert empty.get(5) == [] and len(empty) == 0


def test_ngram_tree_merges_shared_prefixes() -> None:
    tree = ngram_tree([(4, 5, 6), (4, 5, 7), (8, 9, 10), (4, 11, 12)])
    assert tree.tokens.tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert tree.parents.tolist() == [0, 1, 2, 2, 0, 5, 6, 1, 8]
    paths = [[int(tree.tokens[i - 1]) for i in p] for p in tree.paths()]
    assert sorted(paths) == sorted([[4, 5, 6], [4, 5, 7], [8, 9, 10], [4, 11, 12]])
    assert ngram_tree([]).num_nodes == 0


def test_drafter_proposes_pool_candidates_of_the_root(tiny: Transformer) -> None:
    drafter = LookaheadDrafter(LookaheadConfig(3, 3, 2), context_ngrams=True)
    req = Request(tiny, [1, 10, 11, 12, 10, 11, 13, 10], _greedy(8), [2], max_draft=drafter.max_nodes)
    prefill(tiny, req)
    drafter.begin(req, None)
    proposal = drafter.propose(req)
    # Root 10: the prompt's trigrams starting with 10 are (10, 11, 12) and (10, 11, 13).
    assert drafter.pool.get(10) == [(11, 13), (11, 12)]
    assert proposal.tree.tokens.tolist() == [11, 13, 12]
    assert proposal.tree.parents.tolist() == [0, 1, 1]
    assert proposal.num_side == 3 * 2 - 1
    assert proposal.side_mask is not None and proposal.side_mask.shape == (5, 3 + 1 + 5)
    assert not proposal.side_mask[:, 1:4].any()  # side tokens never see the verification branch


def test_a_budget_below_the_proposal_verifies_the_newest_ngram_alone(tiny: Transformer) -> None:
    """Granted fewer tokens than its whole proposal (the load policy weighs it as a chain of
    N-1, `max_chain`), the drafter verifies the pool's newest n-gram of the root, without the
    window: its rows add no accepted token to the step that runs them."""
    drafter = LookaheadDrafter(LookaheadConfig(3, 3, 2), context_ngrams=True)
    assert drafter.max_chain == 2 and drafter.max_nodes > 2
    req = Request(tiny, [1, 10, 11, 12, 10, 11, 13, 10], _greedy(8), [2], max_draft=drafter.max_nodes)
    prefill(tiny, req)
    drafter.begin(req, None)
    for budget, tokens in ((1, [11]), (2, [11, 13]), (4, [11, 13])):
        proposal = drafter.propose(req, budget)
        assert proposal.tree.tokens.tolist() == tokens
        assert proposal.tree.parents.tolist() == list(range(len(tokens)))
        assert proposal.num_side == 0
    assert drafter.propose(req).num_side == 5  # the whole proposal still runs the window


# ------------------------------------------------------------------------------------------------
# Window mask


def test_window_layout_hand_example() -> None:
    """W = 3, two levels; cell order (0,0)=root, (0,1), (0,2), (1,0), (1,1), (1,2)."""
    depths, mask = window_layout(3, 2)
    assert depths.tolist() == [0, 1, 2, 1, 2, 3]
    expected = [
        [1, 0, 0, 0, 0, 0],  # root (its row is not used: the root is not a side token)
        [1, 1, 0, 0, 0, 0],  # (0,1): root, itself
        [1, 1, 1, 0, 0, 0],  # (0,2): root, (0,1), itself
        [1, 0, 0, 1, 0, 0],  # (1,0): root, itself
        [1, 1, 0, 0, 1, 0],  # (1,1): root, (0,1), itself
        [1, 1, 1, 0, 0, 1],  # (1,2): root, (0,1), (0,2), itself
    ]
    assert mask.int().tolist() == expected


@pytest.mark.parametrize(("w", "levels"), [(1, 1), (1, 3), (4, 1), (5, 3), (7, 6)])
def test_window_cells_see_one_token_per_offset(w: int, levels: int) -> None:
    """Every cell's visible cells form one sequence: exactly one cell at each offset 0..depth,
    ending in itself, and including its whole column (its own trajectory)."""
    depths, mask = window_layout(w, levels)
    for i in range(w * levels):
        seen = mask[i].nonzero().flatten()
        assert sorted(depths[seen].tolist()) == list(range(int(depths[i]) + 1))
        assert bool(mask[i, i]) and bool(mask[i, 0])
        column = i % w
        for level in range(1, i // w + 1):
            assert bool(mask[i, level * w + column])


def test_side_rows_are_causal_forwards_of_each_cells_context(tiny: Transformer) -> None:
    """The engine's one forward gives, at every side token, the same state as a plain causal
    forward over the cached prefix plus that cell's guessed context (the lossless part does not
    depend on this, the quality of the n-grams does)."""
    config = LookaheadConfig(3, 4, 2)
    drafter = RecordingDrafter(config)
    prompt = [1, 40, 41, 42, 43, 40, 41, 42, 43]
    _run(tiny, prompt, _greedy(6), drafter)
    assert drafter.results
    w, levels = config.window_size, config.ngram_size - 1
    _, mask = window_layout(w, levels)
    for (ids, cache_len, proposal), result in zip(drafter.steps, drafter.results, strict=False):
        assert proposal.side_tokens is not None and result.side_best is not None
        side = result.hidden[result.num_draft + 1 :]  # (M, C)
        with torch.inference_mode():
            assert result.side_best == tiny.logits(side).argmax(-1).tolist()
        cells = [ids[-1], *proposal.side_tokens.tolist()]
        assert cache_len == len(ids) - 1
        for i in range(1, w * levels):
            context = [cells[k] for k in mask[i].nonzero().flatten().tolist()]  # ordered by offset
            seq = ids[:-1] + context
            cache = tiny.new_cache(len(seq))
            with torch.inference_mode():
                want = tiny(torch.tensor([seq]), torch.arange(len(seq))[None], cache)[0, -1]
            torch.testing.assert_close(side[i - 1], want, atol=1e-4, rtol=1e-4)


def test_window_advances_by_one_jacobi_iteration(tiny: Transformer) -> None:
    """After a step the top level holds the target's argmax at the old top level and the old
    levels moved down one (realign off, so the columns stay put)."""
    drafter = RecordingDrafter(LookaheadConfig(3, 4, 2), context_ngrams=False, realign=False)
    before: list[list[list[int]]] = []  # the window as each observe found it
    recorded = drafter.observe

    def observe(req: Request, result: StepResult) -> None:
        before.append([row[:] for row in drafter.window])
        recorded(req, result)

    drafter.observe = observe  # type: ignore[method-assign]
    _, steps = alone(tiny, [1, 5, 9, 13, 20], _greedy(20), [2], drafter)
    next(steps)
    result = drafter.results[0]
    assert result.side_best is not None
    top = result.side_best[-3:]
    assert drafter.window == [before[0][1], before[0][2], top]


def _fake_step(drafter: LookaheadDrafter, emitted: list[int], argmax: list[int]) -> None:
    """Feed `observe` a step that emitted `emitted` and whose side tokens' argmax is `argmax`."""
    verdict = Verdict(list(range(1, len(emitted))), emitted)
    result = StepResult(verdict, torch.zeros(0, 1), argmax, num_draft=len(emitted) - 1, max_depth=0)
    drafter._step_has_window = True
    drafter.observe(SimpleNamespace(all_ids=[50] * 8 + emitted), result)  # type: ignore[arg-type]


def test_observe_pools_complete_trajectories_and_realigns() -> None:
    """W = 3, N = 3: cells (0,0)=root 10, (0,1)=11, (0,2)=12 / (1,0)=20, (1,1)=21, (1,2)=22."""
    drafter = LookaheadDrafter(LookaheadConfig(3, 3, 2), context_ngrams=False, realign=True)
    drafter.window = [[10, 11, 12], [20, 21, 22]]
    drafter.links = [1, 1, 0]  # column 2 still holds initial fill: not an n-gram yet
    # Side tokens (0,1), (0,2), (1,0), (1,1), (1,2); their argmax 70..74; the top row's are 72..74.
    _fake_step(drafter, emitted=[5], argmax=[70, 71, 72, 73, 74])
    assert drafter.pool.get(10) == [(20, 72)] and drafter.pool.get(11) == [(21, 73)]
    assert 12 not in drafter.pool
    assert drafter.window == [[20, 21, 22], [72, 73, 74]] and drafter.links == [1, 1, 1]
    # A step that emits 3 tokens (2 accepted): the root jumped 2 further, columns shift by 2.
    drafter.window[0][0] = 5
    _fake_step(drafter, emitted=[6, 7, 8], argmax=[80, 81, 82, 83, 84])
    assert drafter.window[0][0] == 74 and drafter.window[1][0] == 84
    assert drafter.links == [1, 0, 0]
    assert all(t == 50 or t in (6, 7, 8) for row in drafter.window for t in row[1:])  # refilled


# ------------------------------------------------------------------------------------------------
# Sampling: exact distribution of 3 generated tokens on a 12-token model


SMALL_VOCAB = 12
NUM_NEW = 3
SAMPLES = 20_000
# The model's greedy continuation of [3, 4, 5] is all 1s: the prompt's n-grams then make drafts
# the target often accepts at temperature 1, so the verification branch is really exercised.
SAMPLE_PROMPT = [3, 4, 5] + [1] * 12
SAMPLE_CONFIG = LookaheadConfig(3, 4, 3)


def _make_small_model(out: Path) -> Transformer:
    sizes = hf_sizes(vocab=SMALL_VOCAB, hidden=32, layers=1, context=64)
    return load_tiny_hf(out, seed=3, std=0.3, sizes=sizes)


def exact_law(model: Transformer, prompt: list[int], params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(t1..t3 | prompt) = prod of the target's processed next-token probabilities, enumerated."""
    law: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(NUM_NEW):
        grown: dict[tuple[int, ...], float] = {}
        for prefix, mass in law.items():
            seq = prompt + list(prefix)
            with torch.inference_mode():
                hidden = model(torch.tensor([seq]), torch.arange(len(seq))[None], model.new_cache(len(seq)))
                probs = logits_to_probs(model.logits(hidden[0, -1]), params).double()  # (V,)
            probs = probs / probs.sum()  # float32 rows sum to 1 only within ~1e-7
            for token, p in enumerate(probs.tolist()):
                grown[(*prefix, token)] = mass * p
        law = grown
    return law


def distribution_check(
    counts: Counter[tuple[int, ...]], law: dict[tuple[int, ...], float]
) -> tuple[bool, str]:
    """Is `counts` (n samples) plausibly drawn from `law`? Two tests, both sized by n:

    - total variation: E[TV] <= 1/2 sum_x sqrt(p(1-p)/n) (Jensen), and TV moves by at most 1/n
      per sample, so by McDiarmid P(TV > E[TV] + t) <= exp(-2 n t^2); t is set for 1e-6.
    - chi-square on the cells with expected count >= 5 (the rest pooled in one cell), p > 1e-6.
    """
    n = sum(counts.values())
    if any(x not in law for x in counts):
        return False, "a sample outside the support"
    tv = 0.5 * sum(abs(counts.get(x, 0) / n - p) for x, p in law.items())
    bound = 0.5 * sum(math.sqrt(p * (1 - p) / n) for p in law.values()) + math.sqrt(math.log(1e6) / (2 * n))
    observed: list[float] = []
    expected: list[float] = []
    rest_obs, rest_exp = 0.0, 0.0
    for x, p in law.items():
        if n * p >= 5:
            observed.append(counts.get(x, 0))
            expected.append(n * p)
        else:
            rest_obs += counts.get(x, 0)
            rest_exp += n * p
    if rest_exp > 0:
        observed.append(rest_obs)
        expected.append(rest_exp)
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    dof = len(expected) - 1
    p_value = chi_square_sf(stat, dof)
    detail = f"n={n} tv={tv:.4f} bound={bound:.4f} chi2={stat:.1f} dof={dof} p={p_value:.3g}"
    return tv < bound and p_value > 1e-6, detail


def _sample_many(
    model: Transformer, params: SamplingParams, n: int, verifier: SamplingVerifier | None = None
) -> tuple[Counter[tuple[int, ...]], int]:
    """n independent lookahead generations from one seeded stream; returns the counts of the
    generated 3-token sequences and the number of accepted draft tokens. `verifier` replaces the
    engine's sampling verification (through the drafter's hook), to plant a bug."""
    counts: Counter[tuple[int, ...]] = Counter()
    # All n at once on one engine: the prompt's blocks are computed once and reused from the
    # prefix cache, and rows enough that no draft is trimmed (each runs as it would alone).
    engine = LLMEngine(model, EngineConfig(max_num_seqs=64, max_batch_tokens=4096, policy=False))
    torch.manual_seed(0)
    seqs = []
    for i in range(n):
        drafter = LookaheadDrafter(SAMPLE_CONFIG, seed=i)
        drafter.sampling_verifier = verifier
        seqs.append(engine.add_request(EngineRequest(str(i), SAMPLE_PROMPT, params, None), drafter))
    while engine.has_unfinished():
        engine.step()
    accepted = sum(seq.req.stats.num_accepted_tokens for seq in seqs)
    for seq in seqs:
        counts[tuple(seq.req.output_ids)] += 1
    return counts, accepted


def _accept_without_checking(
    tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator | None = None
) -> Verdict:
    """A broken verifier: follows the first child at every node, then samples the bonus token."""
    children = tree.children()
    node, accepted = 0, []
    while children[node]:
        node = children[node][0]
        accepted.append(node)
    last = int(torch.multinomial(target_probs[node], 1, generator=generator))
    return Verdict(accepted, [int(tree.tokens[c - 1]) for c in accepted] + [last])


def _recover_from_target(
    tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator | None = None
) -> Verdict:
    """A subtler broken verifier: the right acceptance test (p(x) for a point mass), but after a
    rejection it samples from the unmodified target row instead of the residual."""
    children = tree.children()
    draft = tree.tokens.tolist()
    node, accepted = 0, []
    while True:
        p = target_probs[node]  # (V,)
        for child in children[node]:
            if float(torch.rand((), generator=generator, dtype=p.dtype)) < float(p[draft[child - 1]]):
                accepted.append(child)
                node = child
                break
        else:
            last = int(torch.multinomial(p, 1, generator=generator))
            return Verdict(accepted, [draft[c - 1] for c in accepted] + [last])


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Transformer:
    return _make_small_model(tmp_path_factory.mktemp("vocab12"))


def test_sampling_matches_the_exact_distribution(small_model: Transformer) -> None:
    params = SamplingParams(max_tokens=NUM_NEW, temperature=1.0, ignore_eos=True)
    law = exact_law(small_model, SAMPLE_PROMPT, params)
    assert abs(sum(law.values()) - 1) < 1e-9
    counts, accepted = _sample_many(small_model, params, SAMPLES)
    ok, detail = distribution_check(counts, law)
    assert ok, detail
    # The drafts really were exercised: many draft tokens were accepted.
    assert accepted > SAMPLES, accepted


@pytest.mark.parametrize(
    "broken",
    [_accept_without_checking, _recover_from_target],
    ids=["accept-unchecked", "recover-from-target"],
)
def test_distribution_check_catches_a_broken_verifier(
    small_model: Transformer, broken: SamplingVerifier
) -> None:
    params = SamplingParams(max_tokens=NUM_NEW, temperature=1.0, ignore_eos=True)
    law = exact_law(small_model, SAMPLE_PROMPT, params)
    counts, _ = _sample_many(small_model, params, SAMPLES // 10, verifier=broken)
    ok, detail = distribution_check(counts, law)
    assert not ok, detail
