"""Medusa: greedy output equal to plain greedy decoding (random and trained heads, both tiny
architectures, several trees), settings and tree validation, both medusa_choices forms, the
reference checkpoint layout, wrong-target and missing-heads errors, typical acceptance (opt-in,
its rule, and its bias), losslessness under sampling, the CLI flags, and the shipped heads on the
real model (`real`).

The sampling test runs the real engine, one `Request` (own seed) per sample, on a tiny target
with an 8-token vocabulary and compares 3-token generations with the exact distribution, using
the chi-square + total-variation check of tests/test_draft_model.py. The same check must flag
typical acceptance and a drafter that reports its heads' softmax as the draft distribution of
tokens it actually picked by rank.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from specdecode.cli import build_parser, speculative_settings
from specdecode.drafters.base import Proposal
from specdecode.drafters.medusa import (
    DEFAULT_TREE_NODES,
    MedusaDrafter,
    MedusaHeads,
    best_tree,
    check_fits,
    default_choices,
    load_heads,
    save_heads,
)
from specdecode.errors import SpecDecodeError
from specdecode.llm import LLM
from specdecode.models.transformer import Transformer
from specdecode.request import Request
from specdecode.sampling import SamplingParams, logits_to_probs
from specdecode.spec_config import MedusaConfig, parse_speculative
from specdecode.train.medusa import TrainSettings, objective, positions
from specdecode.train.pipeline import train_loop
from specdecode.tree import DraftTree
from specdecode.verify import verify_typical
from tests.alone import exact_greedy, greedy, prefill, proposal, run, tau
from tests.test_draft_model import sampled_check, small_target
from tests.test_train import own_continuations
from tests.tiny import randomized

pytestmark = pytest.mark.usefixtures("one_thread")


def random_heads(model: Transformer, num_heads: int = 3, seed: int = 0, std: float = 0.3) -> MedusaHeads:
    """Heads that draft something other than the target's next token (untrained heads would
    all repeat the LM head's guess)."""
    c, v = model.config.hidden_size, model.config.vocab_size
    return randomized(lambda: MedusaHeads(num_heads, 1, c, v), seed, std)


PROMPTS = {
    "repetitive": [10, 11, 12, 13, 14, 15] * 5,
    "mixed": [5, 6, 7, 40, 41, 5, 6, 7, 90, 3, 5, 6],
    "counting": list(range(20, 50)),
    "one token": [93],
}
TREES = {
    "default": None,
    "chain": [[0], [0, 0], [0, 0, 0]],
    "paths only, wide": [[0, 0, 0], [1, 0], [2], [3, 1], [5]],
}


# ------------------------------------------------------------------------------------------------
# Greedy equality


@pytest.mark.parametrize("tree", TREES)
def test_greedy_equals_plain_greedy_with_random_heads(target: Transformer, tree: str) -> None:
    heads = random_heads(target)
    for name, prompt in PROMPTS.items():
        plain = run(target, prompt, None, greedy())
        spec = run(target, prompt, MedusaDrafter(heads, target, TREES[tree]), greedy())
        assert spec.output_ids == plain.output_ids, name
        assert spec.stats.num_draft_tokens > 0


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Transformer, MedusaHeads]:
    """A tiny target and heads fitted (a second of training) to its own greedy continuations of
    PROMPTS: an oracle for exactly the rows decoding will show them. The tiny random model's
    text is too chaotic for heads to generalise, so this checks the plumbing instead: heads
    that are right on the rows they were trained on must be right when drafting, which fails
    if the drafter reads any row but the one that produced the root."""
    out = tmp_path_factory.mktemp("medusa_trained")
    model, feats = own_continuations(out, list(PROMPTS.values()))
    settings = TrainSettings(
        data="-", out=str(out), num_heads=3, epochs=100, lr=1e-2, batch_size=64, progress=False
    )
    heads = MedusaHeads(3, 1, model.config.hidden_size, model.config.vocab_size)
    train_loop(
        objective(heads, model.head_weight_t().detach(), positions(feats, 3), settings), out / "state.pt"
    )
    return model, heads


def test_trained_heads_accept_and_stay_exact(trained: tuple[Transformer, MedusaHeads]) -> None:
    model, heads = trained
    runs = {
        name: exact_greedy(model, prompt, MedusaDrafter(heads, model, [[0, 0, 0], [1]]), 80)
        for name, prompt in PROMPTS.items()
    }
    # Drafting starts although the one-token prompt has no row before its root.
    assert runs["one token"].stats.num_accepted_tokens > 0
    assert tau(runs.values()) > 3.5, tau(runs.values())  # 4 = every draft token accepted


def test_room_limits_the_tree(target: Transformer) -> None:
    """Near the end of the context the tree is cut to the room left; output is unchanged."""
    heads = random_heads(target)
    long_prompt = [(7 * i) % 96 for i in range(250)]  # context 256
    drafter = MedusaDrafter(heads, target, None)
    req = run(target, long_prompt, drafter, greedy(40))
    assert req.output_ids == run(target, long_prompt, None, greedy(40)).output_ids
    assert len(req.output_ids) == 6


def test_a_budget_below_the_tree_drafts_each_heads_top_guess(
    target: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given fewer draft tokens than its tree, the drafter chains the first heads' top guesses
    (one token a head, as deep as its heads), and runs only the heads it uses."""
    heads = random_heads(target)
    best = proposal(MedusaDrafter(heads, target, [[0], [0, 0], [0, 0, 0]]), target, PROMPTS["mixed"]).tree
    used: list[int | None] = []  # heads each call of `features` ran
    features = heads.features
    monkeypatch.setattr(heads, "features", lambda h, k=None: (used.append(k), features(h, k))[1])
    for budget in (1, 2):
        drafter = MedusaDrafter(heads, target, None)
        assert drafter.max_chain == 3 and budget < drafter.max_nodes
        req = Request(target, PROMPTS["mixed"], greedy(8), [], drafter.max_nodes)
        drafter.begin(req, prefill(target, req))
        chain = drafter.propose(req, budget).tree
        assert chain.parents.tolist() == list(range(budget))
        assert chain.tokens.tolist() == best.tokens.tolist()[:budget]
        assert used[-1] == budget


# ------------------------------------------------------------------------------------------------
# Settings, trees, checkpoints


BAD = [
    ({"method": "medusa", "medusa_choices": "[[0]]"}, "list of lists"),
    ({"method": "medusa", "medusa_choices": [[0], []]}, "empty"),
    ({"method": "medusa", "medusa_choices": [[0, -1]]}, "non-negative"),
    ({"method": "medusa", "medusa_choices": [[0.5]]}, "non-negative integer"),
    ({"method": "medusa", "heads": ""}, "heads must be a path"),
    ({"method": "medusa", "typical_acceptance": "yes"}, "true or false"),
    ({"method": "medusa", "posterior_threshold": 0.1}, "only applies with typical_acceptance"),
    ({"method": "medusa", "typical_acceptance": True, "posterior_alpha": 0}, "posterior_alpha must be"),
    ({"method": "medusa", "typical_acceptance": True, "posterior_threshold": 1.5}, "posterior_threshold"),
    ({"method": "medusa", "num_heads": 3}, "unknown option num_heads"),
]


@pytest.mark.parametrize(("spec", "words"), BAD, ids=[str(b[0]) for b in BAD])
def test_bad_settings_name_the_setting(spec: dict, words: str) -> None:
    with pytest.raises(SpecDecodeError) as err:
        parse_speculative(spec)
    assert words in str(err.value)


def test_settings_and_typical_acceptance_are_opt_in(target: Transformer) -> None:
    spec = parse_speculative({"method": "medusa", "medusa_choices": [[0], [0, 1]]})
    assert isinstance(spec, MedusaConfig) and spec.medusa_choices == ((0,), (0, 1)) and spec.typical is None
    hash(spec)  # immutable settings
    assert MedusaDrafter(random_heads(target), target).sampling_verifier is None
    on = parse_speculative({"method": "medusa", "typical_acceptance": True, "posterior_alpha": 0.2})
    assert isinstance(on, MedusaConfig) and on.typical == (0.09, 0.2)
    assert MedusaDrafter(random_heads(target), target, typical=on.typical).sampling_verifier is not None


def test_choices_must_fit_the_heads(target: Transformer) -> None:
    heads = random_heads(target, num_heads=3)
    with pytest.raises(SpecDecodeError, match="4 deep but the heads draft only 3"):
        MedusaDrafter(heads, target, [[0], [0, 0, 0, 0]])
    with pytest.raises(SpecDecodeError, match="rank 96, beyond the vocabulary of 96"):
        MedusaDrafter(heads, target, [[0], [96]])
    with pytest.raises(SpecDecodeError, match="empty"):
        MedusaDrafter(heads, target, [[]])


def test_both_choice_forms_build_the_same_tree(target: Transformer) -> None:
    heads = random_heads(target)
    every = [[0], [0, 0], [0, 0, 0], [0, 1], [1], [1, 0], [2]]
    leaves = [[0, 0, 0], [0, 1], [1, 0], [2]]
    a = proposal(MedusaDrafter(heads, target, every), target, PROMPTS["mixed"]).tree
    b = proposal(MedusaDrafter(heads, target, leaves), target, PROMPTS["mixed"]).tree
    assert a.num_nodes == 7
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)


def test_tree_nodes_are_the_heads_top_k(target: Transformer) -> None:
    """Node (depth d, rank r) holds head d-1's r-th best token for the row before the root."""
    heads = random_heads(target)
    tree = proposal(MedusaDrafter(heads, target, [[0, 0], [1], [0, 2]]), target, PROMPTS["mixed"]).tree
    req = Request(target, PROMPTS["mixed"], greedy(8), [])
    hidden = prefill(target, req)[-1]  # (C,)
    with torch.inference_mode():
        top = heads(hidden, target.head_weight_t()).topk(3, dim=-1).indices  # (K, 3)
    # from_choices orders nodes by (depth, path): [0], [1], [0, 0], [0, 2]
    assert tree.tokens.tolist() == [top[0, 0], top[0, 1], top[1, 0], top[1, 2]]
    assert tree.parents.tolist() == [0, 0, 1, 1]


def test_best_tree_and_default_tree() -> None:
    ranks = [[0.5, 0.2, 0.1], [0.6, 0.1]]
    # Path probabilities: [0] .5, [0,0] .3, [1] .2, [1,0] .12, [2] .1, [0,1] .05, ...
    assert best_tree(ranks, 5) == [[0], [0, 0], [1], [1, 0], [2]]
    assert best_tree([[0.1, 0.3]], 2) == [[0], [1]]  # ranks made non-increasing: still prefix-closed
    for k in (1, 2, 4, 5):
        tree = default_choices(k)
        assert len(tree) == DEFAULT_TREE_NODES and max(len(p) for p in tree) <= k
        assert all(p[:-1] in tree for p in tree if len(p) > 1)


def reference_state(heads: MedusaHeads) -> dict[str, torch.Tensor]:
    """The Medusa reference repo's names: head i is Sequential(ResBlock * L, Linear(C, V))."""
    assert heads.lm_heads is not None
    state = {}
    for i in range(heads.num_heads):
        for j in range(heads.num_layers):
            state[f"{i}.{j}.linear.weight"] = heads.blocks[i][j].linear.weight.detach().clone()
            state[f"{i}.{j}.linear.bias"] = heads.blocks[i][j].linear.bias.detach().clone()
        state[f"{i}.{heads.num_layers}.weight"] = heads.lm_heads[i].weight.detach().clone()
    return state


@pytest.mark.parametrize("layers", [1, 2])
def test_reference_layout_drafts_like_our_format(target: Transformer, tmp_path: Path, layers: int) -> None:
    from safetensors.torch import save_file

    cfg = target.config
    c, v = cfg.hidden_size, cfg.vocab_size
    heads = randomized(lambda: MedusaHeads(3, layers, c, v, shared_lm_head=False), layers, 0.3)
    save_heads(heads, tmp_path / "ours", target="tiny", dtype=torch.float32)
    reference = {"medusa_num_heads": 3, "medusa_num_layers": layers, "base_model_name_or_path": "tiny"}
    for name in ("safetensors", "pt"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(reference))
    save_file(reference_state(heads), str(tmp_path / "safetensors" / "medusa_lm_head.safetensors"))
    torch.save(reference_state(heads), tmp_path / "pt" / "medusa_lm_head.pt")

    loaded = {name: load_heads(tmp_path / name) for name in ("ours", "safetensors", "pt")}
    trees = {
        name: proposal(MedusaDrafter(h, target), target, PROMPTS["mixed"]).tree for name, h in loaded.items()
    }
    for name in ("safetensors", "pt"):
        assert not loaded[name].shared_lm_head
        assert torch.equal(trees[name].tokens, trees["ours"].tokens), name
        assert torch.equal(trees[name].parents, trees["ours"].parents), name
    outs = {
        name: run(target, PROMPTS["counting"], MedusaDrafter(h, target), greedy(32))
        for name, h in loaded.items()
    }
    assert outs["ours"].output_ids == outs["pt"].output_ids == outs["safetensors"].output_ids
    assert outs["ours"].stats == outs["pt"].stats == outs["safetensors"].stats


def test_draft_vocabulary_limits_the_drafts(target: Transformer, tmp_path: Path) -> None:
    """Heads with a draft vocabulary draft only its ids (tree and budgeted chain alike), as the
    best of the whole head's logits among those ids, keep it on disk, and stay exact."""
    heads = random_heads(target)
    heads.draft_vocab = torch.arange(0, 96, 3)  # every third id
    loaded = load_heads(save_heads(heads, tmp_path / "h", target="tiny", dtype=torch.float32))
    assert loaded.draft_vocab is not None and loaded.draft_vocab.tolist() == list(range(0, 96, 3))
    assert json.loads((tmp_path / "h" / "config.json").read_text())["draft_vocab_size"] == 32
    drafter = MedusaDrafter(loaded, target)
    req = Request(target, PROMPTS["mixed"], greedy(8), [], drafter.max_nodes)
    drafter.begin(req, prefill(target, req))
    tree, chain = drafter.propose(req).tree, drafter.propose(req, 2).tree
    assert tree.num_nodes > 0 and all(t % 3 == 0 for t in tree.tokens.tolist() + chain.tokens.tolist())
    # Head 0's top guess over the draft vocabulary is the best of the whole head's logits there.
    logits = target.head_weight_t().T @ loaded.features(drafter.hidden, 1)[0]  # (V,)
    assert chain.tokens[0] == 3 * int(logits[::3].argmax())
    for name, prompt in PROMPTS.items():
        spec = run(target, prompt, MedusaDrafter(loaded, target), greedy(24))
        assert spec.output_ids == run(target, prompt, None, greedy(24)).output_ids, name
    with pytest.raises(SpecDecodeError, match="rank 40, beyond the vocabulary of 32"):
        MedusaDrafter(loaded, target, [[0], [40]])


def test_bad_draft_vocabularies_are_named(target: Transformer, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    c, v = target.config.hidden_size, target.config.vocab_size
    with pytest.raises(SpecDecodeError, match="needs the shared LM head"):
        MedusaHeads(2, 1, c, v, shared_lm_head=False, draft_vocab=torch.arange(8))
    heads = MedusaHeads(2, 1, c, v, draft_vocab=torch.arange(8))
    assert heads.draft_head(target) is heads.draft_head(target)  # made once ...
    first = heads.draft_head(target)
    heads.draft_vocab = torch.arange(4)
    assert heads.draft_head(target) is not first  # ... and anew for another vocabulary
    save_heads(heads, tmp_path / "h", target="tiny")
    weights = tmp_path / "h" / "medusa.safetensors"
    tensors = load_file(str(weights))
    for vocab, words in [
        (torch.tensor([1, 2, v]), "outside the vocabulary"),
        (torch.zeros(0, dtype=torch.long), "must list 1 to 96 ids"),
        (torch.arange(6), "does not match draft_vocab_size"),
    ]:
        save_file({**tensors, "draft_vocab": vocab}, str(weights))
        with pytest.raises(SpecDecodeError, match=words):
            load_heads(tmp_path / "h")


def test_heads_for_another_target_are_rejected(target: Transformer, tmp_path: Path) -> None:
    cfg = target.config
    with pytest.raises(SpecDecodeError, match="trained for another target: hidden size 32"):
        check_fits(MedusaHeads(2, 1, 32, cfg.vocab_size), target)
    with pytest.raises(SpecDecodeError, match="vocabulary 100"):
        MedusaDrafter(MedusaHeads(2, 1, cfg.hidden_size, 100), target)
    save_heads(MedusaHeads(2, 1, 32, cfg.vocab_size), tmp_path / "small", target="other")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecDecodeError, match="no Medusa heads in"):
        load_heads(tmp_path / "empty")
    with pytest.raises(SpecDecodeError, match="no such directory"):
        load_heads(tmp_path / "missing")


def test_cli_flags() -> None:
    parser = build_parser()
    base = ["generate", "--prompt", "x"]
    args = parser.parse_args([*base, "--method", "medusa", "--heads", "d", "--medusa-choices", "[[0],[0,1]]"])
    assert speculative_settings(args) == {"method": "medusa", "heads": "d", "medusa_choices": [[0], [0, 1]]}
    args = parser.parse_args([*base, "--typical-acceptance", "--posterior-alpha", "0.2"])
    assert speculative_settings(args) == {
        "method": "medusa",
        "typical_acceptance": True,
        "posterior_alpha": 0.2,
    }
    assert isinstance(parse_speculative(speculative_settings(args)), MedusaConfig)
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--medusa-choices", "[[0],"])


# ------------------------------------------------------------------------------------------------
# Typical acceptance: the rule


def rows(spec: dict[int, dict[int, float]], n: int, vocab: int = 16) -> torch.Tensor:
    """(n, vocab) probability rows: the given entries, the rest spread evenly."""
    out = torch.zeros(n, vocab, dtype=torch.float64)
    for i in range(n):
        given = spec.get(i, {})
        rest = [t for t in range(vocab) if t not in given]
        out[i, rest] = (1 - sum(given.values())) / len(rest) if rest else 0.0
        for t, p in given.items():
            out[i, t] = p
    return out


# The hand tree of test_verify.py: 1[10] and 2[11] under the root; 3[12], 4[13] under 1; 5[14]
# under 3; 6[15] under 2.
HAND = DraftTree(torch.tensor([10, 11, 12, 13, 14, 15]), torch.tensor([0, 0, 1, 1, 3, 2]))


@pytest.mark.parametrize(
    ("probs", "accepted", "last"),
    [
        # Every step typical: the deepest path 1-3-5, then the end row's point mass.
        pytest.param(
            {0: {10: 0.5, 11: 0.5}, 1: {12: 0.9}, 3: {14: 0.9}, 5: {7: 1.0}}, [1, 3, 5], 7, id="deepest"
        ),
        # 14 after 12 is not typical (p 0.01 < 0.09): paths 1-3 and 2-6 tie on depth; 2-6 is likelier.
        pytest.param(
            {0: {10: 0.3, 11: 0.7}, 1: {12: 0.9}, 2: {15: 0.9}, 3: {13: 0.95, 14: 0.01}, 6: {3: 1.0}},
            [2, 6],
            3,
            id="tie-by-likelihood",
        ),
        # Nothing typical: nothing accepted, a token drawn from the root row.
        pytest.param({0: {10: 0.01, 11: 0.01, 9: 0.98}}, [], None, id="none"),
        # A flat row: the bar is alpha * exp(-H) = 0.3/16 < 1/16, so every token there is typical.
        pytest.param({0: {10: 1.0}, 1: {}, 3: {14: 1.0}, 5: {2: 1.0}}, [1, 3, 5], 2, id="flat-row-accepts"),
    ],
)
def test_verify_typical_rule(probs: dict, accepted: list[int], last: int | None) -> None:
    table = rows(probs, HAND.num_nodes + 1)
    verdict = verify_typical(HAND, table, torch.Generator().manual_seed(0))
    assert verdict.accepted_nodes == accepted
    assert verdict.tokens[:-1] == [int(HAND.tokens[c - 1]) for c in accepted]
    if last is not None:
        assert verdict.tokens[-1] == last


# ------------------------------------------------------------------------------------------------
# Sampling: the distribution of generated sequences

SMALL_CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0]]


@pytest.fixture(scope="module")
def small() -> tuple[Transformer, MedusaHeads, dict[tuple[int, ...], float]]:
    target, exact = small_target()
    heads = random_heads(target, num_heads=2, seed=1, std=0.5)
    return target, heads, exact


class ClaimsHeadSoftmax(MedusaDrafter):
    """Picks tokens by rank (deterministic) but reports the heads' softmax as the distribution
    they were drawn from: the verifier's acceptance test and residual are then wrong."""

    def propose(self, req: Request, budget: int | None = None) -> Proposal:
        tree = super().propose(req, budget).tree
        assert self.hidden is not None
        logits = self.heads(self.hidden, self.target.head_weight_t())  # (K, V)
        q = logits_to_probs(logits, req.params)[self.node_head[: tree.num_nodes]]  # (N, V)
        return Proposal(DraftTree(tree.tokens, tree.parents, q))


Factory = Callable[[Transformer, MedusaHeads], MedusaDrafter]
SAMPLERS: dict[str, Factory] = {
    "exact": lambda t, h: MedusaDrafter(h, t, SMALL_CHOICES),
    "typical acceptance": lambda t, h: MedusaDrafter(h, t, SMALL_CHOICES, typical=(0.09, 0.3)),
    "claims the heads' softmax": lambda t, h: ClaimsHeadSoftmax(h, t, SMALL_CHOICES),
}


def test_sampling_is_lossless(small: tuple[Transformer, MedusaHeads, dict]) -> None:
    target, heads, exact = small
    result, mean_tau = sampled_check(target, exact, lambda: SAMPLERS["exact"](target, heads), 5000)
    assert result.ok, result
    assert mean_tau > 1.1, mean_tau  # the drafts were used and often accepted


@pytest.mark.parametrize("method", ["typical acceptance", "claims the heads' softmax"])
def test_check_catches_lossy_variants(small: tuple[Transformer, MedusaHeads, dict], method: str) -> None:
    """Typical acceptance is lossy by design, the liar by mistake: the same check flags both."""
    target, heads, exact = small
    result, _ = sampled_check(target, exact, lambda: SAMPLERS[method](target, heads), 2000)
    assert not result.ok, result
    assert result.p_value < 1e-6, result


def test_typical_acceptance_leaves_greedy_exact(target: Transformer) -> None:
    heads = random_heads(target)
    prompt = PROMPTS["mixed"]
    req = run(target, prompt, MedusaDrafter(heads, target, typical=(0.09, 0.3)), greedy())
    assert req.output_ids == run(target, prompt, None, greedy()).output_ids


# ------------------------------------------------------------------------------------------------
# The shipped heads on the real model


@pytest.mark.real
def test_shipped_heads_on_spec_bench() -> None:
    """Greedy equality and τ >= 1.5 with the heads shipped for SmolLM2-135M and the whole tree
    fitted to them (the default tree is its first DEFAULT_TREE_NODES nodes, sized for speed on a
    CPU), on one question of each Spec-Bench category (the questions live beside the checkout,
    in ../shared, not in it: a clone elsewhere skips)."""
    from specdecode.bench.specbench import DEFAULT_QUESTIONS, load_questions
    from specdecode.drafters.medusa import shipped_heads

    if not DEFAULT_QUESTIONS.is_file():
        pytest.skip(f"no Spec-Bench questions at {DEFAULT_QUESTIONS}")

    fitted = load_heads(shipped_heads("smollm2-135m")).choices
    assert fitted is not None and len(fitted) > DEFAULT_TREE_NODES
    spec = {"method": "medusa", "medusa_choices": fitted}
    llm = LLM(model="smollm2-135m", speculative=spec, progress=False, speculation_policy=False)
    params = SamplingParams(max_tokens=96, temperature=0)
    tokens = forwards = 0
    for q in load_questions(DEFAULT_QUESTIONS, per_category=1, categories=None):
        ids = llm.chat_prompt([{"role": "user", "content": q["turns"][0]}])
        spec = llm.generate([ids], params)[0]
        plain = llm.generate([ids], params, speculative=None)[0]
        assert spec.token_ids == plain.token_ids, q["category"]
        tokens += spec.stats.num_generated_tokens
        forwards += spec.stats.num_target_forwards
    assert tokens / forwards >= 1.5, tokens / forwards
