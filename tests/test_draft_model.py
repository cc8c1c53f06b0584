"""Draft-model speculation: greedy output equal to plain greedy decoding, full acceptance with the
target as its own draft, draft-cache bookkeeping, the room limits, vocabulary checks, and
losslessness under sampling measured against the exact distribution of short generations.

The sampling tests run the real engine, one `Request` (own seed) per sample, on a tiny target
with an 8-token vocabulary, and compare the distribution of 3-token generations with the exact
one, enumerated from the target's processed probabilities. `check_distribution` is a chi-square
test plus a total-variation bound derived from the sample size; it must flag a drafter that lies
about its draft probabilities.
"""

from __future__ import annotations

import copy
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers.models import WordLevel

from specdecode.drafters.base import Drafter, Proposal
from specdecode.drafters.draft_model import DraftModelDrafter, check_vocabularies
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.errors import SpecDecodeError
from specdecode.models.config import ModelConfig
from specdecode.models.tokenizer import Tokenizer
from specdecode.models.transformer import Transformer
from specdecode.request import Request
from specdecode.sampling import SamplingParams, logits_to_probs
from specdecode.spec_config import DraftModelConfig, PromptLookupConfig
from specdecode.tree import DraftTree
from tests.alone import alone, greedy, run, together
from tests.stats import DistributionCheck, chi_square_sf
from tests.tiny import load_tiny_hf, randomized

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_transformer(
    vocab: int, seed: int, layers: int = 1, hidden: int = 32, context: int = 256, std: float = 0.2
) -> Transformer:
    """A random Llama-style model built in memory (smaller than tests/tiny.py's, any vocabulary)."""
    config = ModelConfig(
        arch="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_layers=layers,
        num_heads=2,
        num_kv_heads=1,
        head_dim=hidden // 2,
        max_position_embeddings=context,
        tie_word_embeddings=True,
    )
    return randomized(lambda: Transformer(config), seed, std, matrices_only=True)


def config(k: int, use_draft_logits: bool = True) -> DraftModelConfig:
    return DraftModelConfig(draft_model="tiny", num_draft_tokens=k, use_draft_logits=use_draft_logits)


# ------------------------------------------------------------------------------------------------
# Greedy


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Transformer:
    return load_tiny_hf(tmp_path_factory.mktemp("dm_target"))


@pytest.fixture(scope="module")
def drafts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Transformer]:
    return {
        "same shape, other seed": load_tiny_hf(tmp_path_factory.mktemp("dm_draft"), seed=1),
        "smaller": tiny_transformer(96, seed=2),
        "smaller vocab 90": tiny_transformer(90, seed=3),  # target ids >= 90 reach it as id 0
        "larger vocab 100": tiny_transformer(100, seed=4),  # drafts only ids < 96
    }


PROMPTS = {
    "repetitive": [10, 11, 12, 13, 14, 15] * 5,
    "mixed": [5, 6, 7, 40, 41, 5, 6, 7, 90, 3, 5, 6],
    "counting": list(range(20, 50)),
    "one token": [93],
}


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize(
    "draft_name", ["same shape, other seed", "smaller", "smaller vocab 90", "larger vocab 100"]
)
def test_greedy_equals_plain_greedy(
    target: Transformer, drafts: dict[str, Transformer], draft_name: str, k: int
) -> None:
    for prompt in PROMPTS.values():
        plain = run(target, prompt, None, greedy())
        drafter = DraftModelDrafter(config(k), drafts[draft_name], target.config.vocab_size)
        spec = run(target, prompt, drafter, greedy())
        assert spec.output_ids == plain.output_ids, prompt
        assert len(spec.output_ids) == 64


class CountingDrafter(DraftModelDrafter):
    """Records the number of tokens of every draft forward, grouped by step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.forwards: list[list[int]] = [[]]  # forwards[0]: begin's prefill

    def propose(self, req: Request, budget: int | None = None) -> Proposal:
        self.forwards.append([])
        return super().propose(req, budget)

    def _feed(self, tokens: list[int], prompt: bool = False) -> torch.Tensor:
        if tokens:
            self.forwards[-1].append(len(tokens))
        return super()._feed(tokens, prompt)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_target_as_its_own_draft_accepts_everything(target: Transformer, k: int) -> None:
    """τ = K+1 on every step but the last (cut by max_tokens), and the draft never re-reads:
    after a fully accepted step its cache lacks only the last draft token and the bonus token."""
    prompt = PROMPTS["mixed"]
    drafter = CountingDrafter(config(k), target, target.config.vocab_size)
    req, steps = alone(target, prompt, greedy(61), [], drafter)
    steps = [len(tokens) for tokens in steps]
    assert req.output_ids == run(target, prompt, None, greedy(61)).output_ids
    assert all(n == k + 1 for n in steps[:-1]) and 1 <= steps[-1] <= k + 1, steps
    assert drafter.forwards[0] == [len(prompt) - 1]  # the prefill: prompt without its root
    assert drafter.forwards[1] == [1] * k  # the root, then K-1 draft tokens
    for step in drafter.forwards[2:]:
        assert step == [2] + [1] * (k - 1), drafter.forwards


def test_a_budget_limits_the_draft_models_forwards(target: Transformer) -> None:
    """With a budget of B < K tokens the draft model runs B forwards, not K (the load policy's
    budgets save the drafting they do not verify), and the next step picks up from there."""
    prompt = PROMPTS["mixed"]
    drafter = CountingDrafter(config(5), target, target.config.vocab_size)
    req = Request(target, prompt, greedy(), [], drafter.max_nodes)
    drafter.begin(req, None)
    assert drafter.propose(req, budget=2).tree.tokens.numel() == 2
    assert drafter.forwards[-1] == [1, 1]  # the root, then one draft token (not four)
    assert drafter.propose(req).tree.tokens.numel() == 5  # no budget: the whole K
    assert len(drafter.forwards[-1]) == 5


def test_draft_cache_follows_the_request(target: Transformer, drafts: dict[str, Transformer]) -> None:
    """After every step the draft's cache holds exactly a prefix of the request's tokens."""
    drafter = DraftModelDrafter(config(4), drafts["same shape, other seed"], target.config.vocab_size)
    req, steps = alone(target, PROMPTS["mixed"], greedy(40), [], drafter)
    for _ in steps:
        if req.finish_reason is None:  # observe has run
            assert drafter.cache is not None
            fed = drafter._fed
            assert drafter.cache.length == len(fed) < len(req.all_ids)
            assert fed == req.all_ids[: len(fed)]


def test_draft_window_reads_the_prompts_end(target: Transformer) -> None:
    """`draft_window` W: the draft prefills only the prompt's last W tokens before the root and
    then follows the request from there; output stays plain decoding's."""
    prompt = PROMPTS["counting"]  # 30 tokens
    settings = DraftModelConfig(draft_model="tiny", num_draft_tokens=3, draft_window=8)
    drafter = CountingDrafter(settings, target, target.config.vocab_size)
    req, steps = alone(target, prompt, greedy(24), [], drafter)
    emitted = [len(tokens) for tokens in steps]
    assert req.output_ids == run(target, prompt, None, greedy(24)).output_ids
    assert drafter.forwards[0] == [8]  # the prefill: 8 tokens, not 29
    assert len(drafter.forwards) == len(emitted) + 1  # it drafted at every step
    start = len(prompt) - 1 - 8
    assert drafter._fed == req.all_ids[start : start + len(drafter._fed)]
    for bad in (0, -3, True, 2.5):
        with pytest.raises(SpecDecodeError, match="draft_window"):
            DraftModelConfig(draft_model="tiny", draft_window=bad)  # type: ignore[arg-type]


def test_draft_vocab_size_proposes_the_first_ids(target: Transformer, drafts: dict[str, Transformer]) -> None:
    """With a head over its first N ids the draft proposes only those, and its rows are
    distributions over them (zero past N); greedy output stays plain decoding's."""
    v = target.config.vocab_size
    draft = drafts["smaller"]
    head = draft.approx_head(torch.arange(40))
    for prompt in PROMPTS.values():
        drafter = DraftModelDrafter(config(3), draft, v, head=head)
        assert (
            run(target, prompt, drafter, greedy()).output_ids
            == run(target, prompt, None, greedy()).output_ids
        )
    for temperature in (0.0, 1.0):
        drafter = DraftModelDrafter(config(3), draft, v, head=head)
        req = Request(
            target, PROMPTS["mixed"], SamplingParams(max_tokens=8, temperature=temperature, seed=0), [], 3
        )
        drafter.begin(req, None)
        tree = drafter.propose(req).tree
        assert tree.num_nodes == 3 and bool((tree.tokens < 40).all())
        if temperature:
            q = tree.draft_probs
            assert q is not None and q.shape == (3, v)
            torch.testing.assert_close(q.sum(-1), torch.ones(3))
            assert float(q[:, 40:].abs().sum()) == 0.0
    with pytest.raises(SpecDecodeError, match="draft_vocab_size"):
        DraftModelConfig(draft_model="tiny", draft_vocab_size=-1)


def test_room_limits_the_draft(target: Transformer, drafts: dict[str, Transformer]) -> None:
    """Near the target's context the draft is clamped to the room left; with a draft whose
    context is shorter than the request, drafting stops and decoding goes on plainly."""
    long_prompt = [(7 * i) % 96 for i in range(250)]  # context 256: 6 tokens of room
    for draft in (drafts["smaller"], tiny_transformer(96, seed=5, context=64)):
        for prompt in (long_prompt, long_prompt[:40]):
            drafter = DraftModelDrafter(config(5), draft, target.config.vocab_size)
            spec, steps = alone(target, prompt, greedy(40), [], drafter)
            drafted = False
            for _ in steps:  # the engine releases the draft's cache when the request ends
                if drafter.cache is not None:
                    drafted = True
                    assert drafter.cache.length <= drafter.cache.max_len
            assert drafted or prompt is long_prompt  # a long prompt outgrows the short draft
            assert spec.output_ids == run(target, prompt, None, greedy(40)).output_ids


def test_draft_probs_shapes(target: Transformer, drafts: dict[str, Transformer]) -> None:
    """Rows over the target's vocabulary, each a distribution that gave its token positive mass;
    zero past the draft's vocabulary; none for greedy or without use_draft_logits."""
    v = target.config.vocab_size
    for name in ("smaller", "smaller vocab 90", "larger vocab 100"):
        for use_logits, temperature in ((True, 1.0), (False, 1.0), (True, 0.0)):
            drafter = DraftModelDrafter(config(3, use_logits), drafts[name], v)
            params = SamplingParams(max_tokens=8, temperature=temperature, seed=0)
            req = Request(target, PROMPTS["mixed"], params, [], drafter.max_nodes)
            drafter.begin(req, None)
            tree = drafter.propose(req).tree
            assert tree.num_nodes == 3 and tree.parents.tolist() == [0, 1, 2]
            assert bool((tree.tokens < min(v, drafts[name].config.vocab_size)).all())
            if not use_logits or temperature == 0:
                assert tree.draft_probs is None
                continue
            q = tree.draft_probs
            assert q is not None and q.shape == (3, v)
            torch.testing.assert_close(q.sum(-1), torch.ones(3))
            assert bool((q[torch.arange(3), tree.tokens] > 0).all())
            assert float(q[:, drafts[name].config.vocab_size :].abs().sum()) == 0.0


# ------------------------------------------------------------------------------------------------
# Vocabulary check


def tokenizer(tokens: list[str]) -> Tokenizer:
    return Tokenizer(Backend(WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=tokens[0])))


def test_check_vocabularies() -> None:
    base = ["<unk>", "a", "b", "c", "d"]
    check_vocabularies(tokenizer(base), tokenizer(list(base)))
    # Ids past the smaller vocabulary (or embedding) are padding or unreachable: ignored.
    check_vocabularies(tokenizer(base), tokenizer([*base, "e", "f"]))
    check_vocabularies(
        tokenizer([*base, "x"]), tokenizer([*base, "y"]), target_vocab_size=5, draft_vocab_size=6
    )
    with pytest.raises(
        SpecDecodeError, match=r"'small-draft'.*'big-target'.*id 3 is 'c' in the target, 'C' in the draft"
    ):
        check_vocabularies(
            tokenizer(base),
            tokenizer(["<unk>", "a", "b", "C", "d"]),
            target_name="big-target",
            draft_name="small-draft",
        )
    with pytest.raises(SpecDecodeError, match="does not share the vocabulary"):
        check_vocabularies(tokenizer([*base, "x"]), tokenizer([*base, "y"]))


# ------------------------------------------------------------------------------------------------
# Sampling: the distribution of generated sequences


DELTA = 1e-6  # probability that an exact method exceeds the total-variation bound
SMALL_V = 8
SEQ_LEN = 3
PROMPT = [1, 2, 3, 1, 2]  # repeats, so prompt lookup drafts
PARAMS: dict[str, Any] = dict(temperature=0.9, top_k=6)  # top-k: some sequences are impossible


def check_distribution(
    samples: Counter[tuple[int, ...]], exact: dict[tuple[int, ...], float]
) -> DistributionCheck:
    """Compare sample counts with exact probabilities (summing to 1 over `exact`'s keys).

    Chi-square: cells expected fewer than 5 times are pooled into one (the test's usual validity
    rule); a sample outside the support fails outright. Total variation: E[TV] <=
    sum_i sqrt(p_i (1-p_i) / n) / 2 (Jensen on each |count_i/n - p_i|), and TV moves by at most
    1/n when one sample changes, so by McDiarmid TV exceeds that mean bound by more than
    sqrt(ln(1/DELTA) / (2n)) with probability at most DELTA.
    """
    n = sum(samples.values())
    if any(exact.get(seq, 0.0) <= 0.0 for seq in samples):
        return DistributionCheck(n, 0.0, 1.0, 0.0)
    expected = {seq: n * p for seq, p in exact.items()}
    cells = sorted(expected, key=expected.__getitem__)  # ascending: the small ones first
    small = [seq for seq in cells if expected[seq] < 5]
    groups = [[seq] for seq in cells[len(small) :]]
    if small:  # one pooled cell; if still under 5, folded into the smallest regular cell
        if sum(expected[seq] for seq in small) >= 5 or not groups:
            groups.append(small)
        else:
            groups[0] += small
    stat = 0.0
    for group in groups:
        e = sum(expected[seq] for seq in group)
        o = sum(samples.get(seq, 0) for seq in group)
        stat += (o - e) ** 2 / e
    df = max(len(groups) - 1, 1)
    tv = 0.5 * sum(abs(samples.get(seq, 0) / n - p) for seq, p in exact.items())
    mean_bound = 0.5 * sum(math.sqrt(p * (1 - p) / n) for p in exact.values())
    bound = mean_bound + math.sqrt(math.log(1 / DELTA) / (2 * n))
    return DistributionCheck(n, chi_square_sf(stat, df), tv, bound)


@torch.inference_mode()
def exact_distribution(model: Transformer, prompt: list[int], length: int) -> dict[tuple[int, ...], float]:
    """Probability of every `length`-token continuation under plain sampling with PARAMS."""
    params = SamplingParams(**PARAMS)
    out: dict[tuple[int, ...], float] = {}
    for seq in itertools.product(range(model.config.vocab_size), repeat=length):
        ids = prompt + list(seq)
        cache = model.new_cache(len(ids))
        hidden = model(torch.tensor([ids[:-1]]), torch.arange(len(ids) - 1)[None], cache)[0]  # (T-1, C)
        rows = logits_to_probs(model.logits(hidden[len(prompt) - 1 :]).double(), params)  # (length, V)
        out[seq] = float(rows[torch.arange(length), torch.tensor(seq)].prod())
    return out


def small_target() -> tuple[Transformer, dict[tuple[int, ...], float]]:
    """The sampling tests' target (a SMALL_V-token vocabulary) and the exact distribution of its
    SEQ_LEN-token continuations of PROMPT."""
    target = tiny_transformer(SMALL_V, seed=10, hidden=16, std=0.5)
    return target, exact_distribution(target, PROMPT, SEQ_LEN)


Small = tuple[Transformer, Transformer, dict[tuple[int, ...], float]]


@pytest.fixture(scope="module")
def small() -> Small:
    """Target, a related draft (the target's weights plus noise), and the exact distribution."""
    target, exact = small_target()
    draft = copy.deepcopy(target)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() == 2:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return target, draft, exact


class LyingDrafter(DraftModelDrafter):
    """Draws from the draft's q but reports another distribution, so the verifier's acceptance
    test and residual are computed for the wrong q, which biases the output.

    `uniform_share` 1: claims q is uniform (a gross lie). 0.1: reports 0.9 q + 0.1 uniform, as if
    the draw had been filtered (top-k) but the reported q had not: a subtle one."""

    def __init__(self, uniform_share: float, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.uniform_share = uniform_share

    def propose(self, req: Request, budget: int | None = None) -> Proposal:
        tree = super().propose(req, budget).tree
        q = tree.draft_probs  # (N, V)
        if q is None:
            return Proposal(tree)
        claimed = (1 - self.uniform_share) * q + self.uniform_share / q.shape[1]  # (N, V)
        return Proposal(DraftTree.chain(tree.tokens, claimed))


Factory = Callable[[Transformer, Transformer], Drafter | None]
METHODS: dict[str, Factory] = {
    "draft model, draft logits": lambda t, d: DraftModelDrafter(config(2, True), d, SMALL_V),
    "draft model, token matching": lambda t, d: DraftModelDrafter(config(2, False), d, SMALL_V),
    "draft model, its first 5 ids": lambda t, d: DraftModelDrafter(
        config(2), d, SMALL_V, head=d.approx_head(torch.arange(5))
    ),
    "prompt lookup": lambda t, d: PromptLookupDrafter(PromptLookupConfig(2, 2)),
    "prompt lookup + draft model": lambda t, d: PromptLookupDrafter(
        PromptLookupConfig(2, 2, num_draft_tokens=2), DraftModelDrafter(config(2), d, SMALL_V)
    ),
    "draft model claiming a uniform q": lambda t, d: LyingDrafter(1.0, config(2, True), d, SMALL_V),
    "draft model claiming 0.9 q + 0.1 uniform": lambda t, d: LyingDrafter(0.1, config(2, True), d, SMALL_V),
}


def sample_outputs(
    target: Transformer, make_drafter: Callable[[], Drafter | None], n: int
) -> tuple[Counter[tuple[int, ...]], float]:
    """n generations of SEQ_LEN tokens from PROMPT, each its own request, seed and fresh drafter;
    returns how often each output came and the mean τ (what every lossless-sampling test needs)."""
    params = [SamplingParams(max_tokens=SEQ_LEN, seed=seed, ignore_eos=True, **PARAMS) for seed in range(n)]
    reqs = together(target, PROMPT, params, make_drafter)
    counts = Counter(tuple(req.output_ids) for req in reqs)
    forwards = sum(req.stats.num_target_forwards for req in reqs)
    return counts, n * SEQ_LEN / forwards


def sampled_check(
    target: Transformer,
    exact: dict[tuple[int, ...], float],
    make_drafter: Callable[[], Drafter | None],
    n: int,
) -> tuple[DistributionCheck, float]:
    """`sample_outputs` checked against `exact` (`small_target`'s): the check and the mean τ."""
    counts, tau = sample_outputs(target, make_drafter, n)
    return check_distribution(counts, exact), tau


def test_exact_distribution_and_check_on_plain_sampling(small: Small) -> None:
    """The enumeration sums to 1 and plain sampling through the engine passes the check."""
    target, _, exact = small
    assert abs(sum(exact.values()) - 1) < 1e-5  # float32 rows (logits_to_probs)
    assert sum(p > 0 for p in exact.values()) == 6**SEQ_LEN  # top-k 6 of 8 at every position
    counts: Counter[tuple[int, ...]] = Counter()
    for seed in range(1000):
        params = SamplingParams(max_tokens=SEQ_LEN, seed=seed, ignore_eos=True, **PARAMS)
        counts[tuple(run(target, PROMPT, None, params).output_ids)] += 1
    assert check_distribution(counts, exact).ok


# Samples per method: 20k per method would take minutes here (2-4 ms per sample, dominated by
# the tiny models' per-forward overhead), so the default run uses a few thousand (this file
# stays under a minute on two busy cores) and the `slow` run the full 20k. The check's
# thresholds follow n; the liars below show the default sizes still have the power needed.
DEFAULT_N = {
    "draft model, draft logits": 2500,
    "draft model, token matching": 2000,
    "draft model, its first 5 ids": 2000,
    "prompt lookup": 3000,
    "prompt lookup + draft model": 1500,
}


@pytest.mark.parametrize("method", DEFAULT_N)
def test_sampling_is_lossless(small: Small, method: str) -> None:
    target, draft, exact = small
    t0 = time.perf_counter()
    result, tau = sampled_check(target, exact, lambda: METHODS[method](target, draft), DEFAULT_N[method])
    elapsed = time.perf_counter() - t0
    assert result.ok, (result, tau, elapsed)
    assert tau > 1.0  # some drafts were accepted: the verifier really ran on them


@pytest.mark.slow
@pytest.mark.parametrize("method", DEFAULT_N)
def test_sampling_is_lossless_20k(small: Small, method: str) -> None:
    target, draft, exact = small
    result, _ = sampled_check(target, exact, lambda: METHODS[method](target, draft), 20_000)
    assert result.ok, result


@pytest.mark.parametrize(
    "method,n",
    [("draft model claiming a uniform q", 1000), ("draft model claiming 0.9 q + 0.1 uniform", 5000)],
)
def test_check_catches_lying_draft_probs(small: Small, method: str, n: int) -> None:
    """The same check, with no more samples than the honest methods get, flags both liars."""
    target, draft, exact = small
    result, _ = sampled_check(target, exact, lambda: METHODS[method](target, draft), n)
    assert not result.ok, result
    assert result.p_value < 1e-6, result
