"""The prompt-lookup branch grafted onto the trained drafters' trees (`LookupBranch`).

`DraftTree.graft` reuses the nodes a chain shares with the tree and appends the rest after every
existing node, point masses under sampling. Each trained drafter wrapped in the branch stays
exact: greedy output equals plain decoding, sampling keeps the target distribution (the
branch's nodes must really be in the trees verified, which the tests count). The settings key
`prompt_lookup_num_tokens` turns it on by default and off with 0.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from specdecode.cli import build_parser, speculative_settings
from specdecode.drafters.base import Drafter, Proposal
from specdecode.drafters.eagle import EagleDrafter
from specdecode.drafters.lookup_branch import LookupBranch
from specdecode.drafters.medusa import MedusaDrafter
from specdecode.drafters.redrafter import ReDrafter
from specdecode.errors import SpecDecodeError
from specdecode.models.transformer import Transformer
from specdecode.request import Request
from specdecode.spec_config import DEFAULT_LOOKUP_TOKENS, Eagle2Config, MedusaConfig, parse_speculative
from specdecode.tree import DraftTree
from tests.alone import alone, greedy, prefill, run
from tests.test_draft_model import sampled_check, small_target
from tests.test_eagle import oracle, random_head
from tests.test_medusa import random_heads
from tests.test_redrafter import random_head as random_redrafter
from tests.tiny import copy_with_chat_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

# ------------------------------------------------------------------------------------------------
# Grafting a chain onto a tree


def example() -> DraftTree:
    """root -> 1:a(5) -> 3:c(7); root -> 2:b(6)."""
    return DraftTree(torch.tensor([5, 6, 7]), torch.tensor([0, 0, 1]))


def test_graft_follows_matching_nodes_then_appends() -> None:
    tree = example().graft([5, 7, 8, 9])  # a, c exist; 8 and 9 are new under c
    assert tree.tokens.tolist() == [5, 6, 7, 8, 9]
    assert tree.parents.tolist() == [0, 0, 1, 3, 4]


def test_graft_adds_a_new_root_child_after_the_existing_ones() -> None:
    tree = example().graft([9, 5])  # 5 under 9 is not node 1: only the path from the root is shared
    assert tree.tokens.tolist() == [5, 6, 7, 9, 5]
    assert tree.parents.tolist() == [0, 0, 1, 0, 4]
    assert tree.children()[0] == [1, 2, 4]  # tried after the drafter's own siblings


def test_graft_of_a_path_the_tree_has_is_the_tree() -> None:
    tree = example()
    assert tree.graft([5, 7]) is tree
    assert tree.graft([]) is tree


def test_graft_declares_point_masses_under_sampling() -> None:
    q = torch.softmax(torch.randn(3, 10), dim=-1)  # (N, V)
    tree = DraftTree(torch.tensor([5, 6, 7]), torch.tensor([0, 0, 1]), q).graft([6, 2, 4])
    assert tree.draft_probs is not None
    assert torch.equal(tree.draft_probs[:3], q)  # the drafter's own rows are kept
    assert tree.draft_probs[3:].argmax(-1).tolist() == [2, 4]
    assert tree.draft_probs[3:].sum(-1).tolist() == [1.0, 1.0]
    assert tree.parents.tolist() == [0, 0, 1, 2, 4]


def test_graft_onto_the_empty_tree_is_the_chain() -> None:
    tree = DraftTree.empty().graft([3, 4, 5])
    assert tree.tokens.tolist() == [3, 4, 5] and tree.parents.tolist() == [0, 1, 2]


# ------------------------------------------------------------------------------------------------
# Exactness of every trained drafter with the branch

Make = Callable[[Transformer], Drafter]
TRAINED: dict[str, Make] = {
    "medusa": lambda t: MedusaDrafter(random_heads(t), t, [[0, 0], [1], [0, 1]]),
    "redrafter": lambda t: ReDrafter(random_redrafter(t), t, 2, 4),
    "eagle": lambda t: EagleDrafter.static(random_head(t), t, [[0, 0, 0], [1, 0], [2]]),
    "eagle2": lambda t: EagleDrafter.dynamic(random_head(t), t, depth=3, top_k=3, total_tokens=6),
}
PROMPTS = {
    "repetitive": [10, 11, 12, 13, 14, 15] * 5,
    "mixed": [5, 6, 7, 40, 41, 5, 6, 7, 90, 3, 5, 6],
    "one token": [93],
}


@pytest.mark.parametrize("name", TRAINED)
def test_greedy_equals_plain_greedy_with_the_branch(target: Transformer, name: str) -> None:
    grafted = 0
    for prompt_name, prompt in PROMPTS.items():
        drafter = LookupBranch(TRAINED[name](target), 4)
        spec = run(target, prompt, drafter, greedy(40))
        assert spec.output_ids == run(target, prompt, None, greedy(40)).output_ids, prompt_name
        grafted += drafter.grafted
    assert grafted > 0  # the lookup nodes were really verified


def test_the_branch_accepts_what_the_heads_miss(target: Transformer) -> None:
    """A random head rarely guesses a tiny model's repetitive output; lookup copies it."""
    prompt = PROMPTS["repetitive"]
    alone = run(target, prompt, TRAINED["eagle2"](target), greedy(40))
    both = run(target, prompt, LookupBranch(TRAINED["eagle2"](target), 4), greedy(40))
    assert both.output_ids == alone.output_ids
    assert both.stats.num_target_forwards < alone.stats.num_target_forwards


def test_room_limits_the_branch(target: Transformer) -> None:
    """Near the end of the context, tree plus branch still fit the request's cache."""
    prompt = [10, 11, 12, 13] * 62  # 248 of a 256-token context
    drafter = LookupBranch(TRAINED["eagle2"](target), 6)
    spec = run(target, prompt, drafter, greedy(8))
    assert spec.output_ids == run(target, prompt, None, greedy(8)).output_ids


def test_the_inner_drafter_sees_steps_won_by_the_branch() -> None:
    """On a target whose next token depends on the current one only (`oracle`'s), greedy output
    soon cycles; lookup then drafts it whole while a random EAGLE head does not. EAGLE's head
    cache still gets one pair per decided token after the steps the branch won (queued until it
    next drafts), and the output stays exact."""
    target, _ = oracle()
    drafter = LookupBranch(TRAINED["eagle2"](target), 4)
    inner = drafter.inner
    assert isinstance(inner, EagleDrafter)
    req, steps = alone(target, PROMPTS["mixed"], greedy(80), [], drafter)
    emitted = []
    for tokens in steps:
        emitted.append(len(tokens))
        if req.finish_reason is None:
            queued = sum(len(tokens) for tokens, _ in inner.pending)
            assert inner.cache.length + queued == len(req.all_ids) - 1  # every decided token but the root
    assert req.output_ids == run(target, PROMPTS["mixed"], None, greedy(80)).output_ids
    assert emitted.count(4) >= 10, emitted  # the output's 3-cycle copied whole, plus the bonus token
    assert drafter.grafted > 0


N_SAMPLES = 1000


@pytest.fixture(scope="module")
def small() -> tuple[Transformer, dict[tuple[int, ...], float]]:
    return small_target()


@pytest.mark.parametrize("name", ["eagle2", "medusa", "redrafter"])
def test_sampling_is_lossless_with_the_branch(small: tuple, name: str) -> None:
    """The prompt repeats, so the branch drafts; its point masses come after the drafter's own
    sampled siblings, whose declared distributions stay as they were."""
    target, exact = small
    made: list[LookupBranch] = []

    def make() -> Drafter:
        made.append(LookupBranch(TRAINED[name](target), 3))
        return made[-1]

    result, tau = sampled_check(target, exact, make, N_SAMPLES)
    assert result.ok, (result, tau)
    assert sum(d.grafted for d in made) > N_SAMPLES // 4  # the branch was in many verified trees


# ------------------------------------------------------------------------------------------------
# Settings


def test_settings_default_on_and_off_with_zero() -> None:
    spec = parse_speculative({"method": "eagle2"})
    assert isinstance(spec, Eagle2Config)
    assert spec.prompt_lookup_num_tokens == DEFAULT_LOOKUP_TOKENS > 0
    off = parse_speculative({"method": "medusa", "prompt_lookup_num_tokens": 0})
    assert isinstance(off, MedusaConfig) and off.prompt_lookup_num_tokens == 0
    for method in ("medusa", "redrafter", "eagle", "eagle2"):
        parse_speculative({"method": method, "prompt_lookup_num_tokens": 8, "max_matching_ngram_size": 3})


@pytest.mark.parametrize(
    "spec,words",
    [
        (
            {"method": "eagle", "prompt_lookup_num_tokens": -1},
            "eagle: prompt_lookup_num_tokens must be an integer >= 0",
        ),
        ({"method": "redrafter", "prompt_lookup_num_tokens": True}, "redrafter: prompt_lookup_num_tokens"),
        ({"method": "medusa", "prompt_lookup_num_tokens": "4"}, "medusa: prompt_lookup_num_tokens"),
        (
            {"method": "eagle2", "max_matching_ngram_size": 0},
            "eagle2: max_matching_ngram_size must be a positive",
        ),
    ],
)
def test_bad_branch_settings_name_the_setting(spec: dict, words: str) -> None:
    with pytest.raises(SpecDecodeError, match=words):
        parse_speculative(spec)


def test_llm_wraps_the_trained_drafter_unless_off(tiny_model_dir: Path, tmp_path: Path) -> None:
    from specdecode.drafters.medusa import save_heads
    from specdecode.llm import LLM

    llm = LLM(model=str(copy_with_chat_tokenizer(tiny_model_dir, tmp_path / "m")), progress=False)
    heads = str(save_heads(random_heads(llm.model), tmp_path / "heads", target="tiny", dtype=torch.float32))
    on = llm.drafters.build(parse_speculative({"method": "medusa", "heads": heads}))
    off = llm.drafters.build(
        parse_speculative({"method": "medusa", "heads": heads, "prompt_lookup_num_tokens": 0})
    )
    assert isinstance(on, LookupBranch) and isinstance(on.inner, MedusaDrafter)
    assert on.max_nodes == on.inner.max_nodes + DEFAULT_LOOKUP_TOKENS
    assert isinstance(off, MedusaDrafter)


def test_cli_flags_reach_the_trained_methods() -> None:
    args = build_parser().parse_args(
        ["generate", "--prompt", "x", "--method", "eagle2", "--prompt-lookup-num-tokens", "0"]
    )
    spec = parse_speculative(speculative_settings(args))
    assert isinstance(spec, Eagle2Config) and spec.prompt_lookup_num_tokens == 0


def test_a_budget_below_the_tree_takes_the_lookup_chain_first(target: Transformer) -> None:
    """Granted fewer tokens than its tree holds (a chain, see `Drafter.max_chain`), the branch
    proposes the lookup's continuation where the text has one, without its drafter's forwards,
    else its drafter's chain; `source` says which before the budget is chosen (the policy costs
    each way on its own)."""
    asked: list[int | None] = []

    class Counting(EagleDrafter):
        def propose(self, req: Request, budget: int | None = None) -> Proposal:
            asked.append(budget)
            return super().propose(req, budget)

    head = random_head(target)
    for prompt, lookup in (([10, 11, 12, 13, 14, 15] * 5, [10, 11]), ([50, 51, 52, 53], None)):
        branch = LookupBranch(Counting(head, target, grow=(3, 3, 8)), 4)
        assert branch.max_chain == 3
        req = Request(target, prompt, greedy(8), [], branch.max_nodes)
        branch.begin(req, prefill(target, req))
        asked.clear()
        assert branch.source(req) == ("lookup:4" if lookup is not None else "inner") and asked == []
        tree = branch.propose(req, 2)
        assert tree.tree.parents.tolist() == [0, 1]
        if lookup is not None:
            assert tree.tree.tokens.tolist() == lookup and asked == []
        else:
            assert asked == [2]  # the drafter's own chain
