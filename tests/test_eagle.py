"""EAGLE-1 / EAGLE-2: greedy output equal to plain greedy decoding (random heads, both tiny
architectures, static trees and dynamic settings down to depth 1 and one verified node), full
acceptance with an oracle head (which checks that drafting feeds the right tokens, features and
cache entries), losslessness under sampling, tree and settings validation, the reference
checkpoint layout, wrong-target and missing-head errors, the CLI flags, `specdecode train eagle`
end to end with resume, and the shipped head on the real model (`real`).

The oracle: a one-layer target whose attention output projection is zero computes each
feature from its own token alone, so a head whose fc passes the embedding through and whose
layer is a copy of the target's (with its input norm) reproduces the target's features up to
the final norm's scale (its weight is ones), and thus its greedy tokens, at every depth.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specdecode.cli import build_parser, main, speculative_settings
from specdecode.drafters.base import Proposal
from specdecode.drafters.eagle import EagleDrafter, EagleHead, load_head, save_head
from specdecode.engine.drafter_factory import DrafterFactory
from specdecode.errors import SpecDecodeError
from specdecode.llm import LLM
from specdecode.models.transformer import Transformer
from specdecode.request import Request
from specdecode.sampling import SamplingParams
from specdecode.spec_config import Eagle2Config, EagleConfig, parse_speculative
from specdecode.train.eagle import IGNORE, Batch, TrainSettings, eagle_loss, objective, unroll_pairs
from specdecode.train.features import extract
from specdecode.tree import DraftTree
from tests.alone import alone, greedy, prefill, proposal, run
from tests.test_draft_model import sampled_check, small_target, tiny_transformer
from tests.test_train import check_resume_is_exact, check_trained_run, random_samples, run_train_command
from tests.tiny import randomized

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = {
    "repetitive": [10, 11, 12, 13, 14, 15] * 5,
    "mixed": [5, 6, 7, 40, 41, 5, 6, 7, 90, 3, 5, 6],
    "one token": [93],
}
Make = Callable[[EagleHead, Transformer], EagleDrafter]
DRAFTERS: dict[str, Make] = {
    "eagle, fitted-less default tree": lambda h, t: EagleDrafter.static(h, t),
    "eagle, chain": lambda h, t: EagleDrafter.static(h, t, [[0, 0, 0]]),
    "eagle, paths only, wide": lambda h, t: EagleDrafter.static(h, t, [[0, 0, 0], [1, 0], [2], [3, 1], [5]]),
    "eagle2, defaults": lambda h, t: EagleDrafter.dynamic(h, t),
    "eagle2, depth 1": lambda h, t: EagleDrafter.dynamic(h, t, depth=1, top_k=4, total_tokens=4),
    "eagle2, one node": lambda h, t: EagleDrafter.dynamic(h, t, depth=4, top_k=3, total_tokens=1),
    "eagle2, narrow deep": lambda h, t: EagleDrafter.dynamic(h, t, depth=6, top_k=1, total_tokens=6),
}


def random_head(model: Transformer, seed: int = 0, std: float = 0.3) -> EagleHead:
    return randomized(lambda: EagleHead.for_target(model.config), seed, std)


def propose_with_budget(drafter: EagleDrafter, model: Transformer, budget: int | None) -> DraftTree:
    """`drafter`'s first proposal for a greedy request of the mixed prompt under `budget`."""
    req = Request(model, PROMPTS["mixed"], greedy(8), [], drafter.max_nodes)
    drafter.begin(req, prefill(model, req))
    return drafter.propose(req, budget).tree


# ------------------------------------------------------------------------------------------------
# Greedy


@pytest.mark.parametrize("name", DRAFTERS)
def test_greedy_equals_plain_greedy_with_random_heads(target: Transformer, name: str) -> None:
    head = random_head(target)
    for prompt_name, prompt in PROMPTS.items():
        plain = run(target, prompt, None, greedy(24))
        spec = run(target, prompt, DRAFTERS[name](head, target), greedy(24))
        assert spec.output_ids == plain.output_ids, prompt_name
        assert spec.stats.num_draft_tokens > 0


def test_draft_vocabulary_limits_the_drafts(target: Transformer, tmp_path: Path) -> None:
    """A head with a draft vocabulary drafts only its ids, stays exact, and keeps it on disk."""
    head = random_head(target)
    head.draft_vocab = torch.arange(0, 96, 3)  # every third id
    head = load_head(save_head(head, tmp_path / "h", target="tiny", dtype=torch.float32))
    assert head.draft_vocab is not None and head.draft_vocab.tolist() == list(range(0, 96, 3))
    for name in ("eagle, paths only, wide", "eagle2, defaults"):
        drafter = DRAFTERS[name](head, target)
        tree = proposal(drafter, target, PROMPTS["mixed"]).tree
        assert tree.num_nodes > 0 and all(t % 3 == 0 for t in tree.tokens.tolist())
        for prompt in PROMPTS.values():
            spec = run(target, prompt, DRAFTERS[name](head, target), greedy(24))
            assert spec.output_ids == run(target, prompt, None, greedy(24)).output_ids


def oracle(vocab: int = 96, seed: int = 5) -> tuple[Transformer, EagleHead]:
    """A one-layer target without attention output, and the head that reproduces it."""
    target = tiny_transformer(vocab, seed=seed, layers=1, hidden=32, std=0.5)
    with torch.no_grad():
        target.layers[0].o.weight_t.zero_()
    head = EagleHead(target.config, fc_bias=False, input_norm=True)
    c = target.config.hidden_size
    with torch.no_grad():
        head.fc.weight_t.zero_()
        head.fc.weight_t[:c] = torch.eye(c)  # the embedding half passes through
        head.layer.load_state_dict(target.layers[0].state_dict())
    return target, head.eval()


@pytest.mark.parametrize(
    "name,per_step",
    [("eagle, chain", 4), ("eagle2, narrow deep", 7), ("eagle2, defaults", 4)],
)
def test_oracle_head_is_always_accepted(name: str, per_step: int) -> None:
    """Every step emits depth + 1 tokens but the last (cut by max_tokens): drafts at every depth
    came from the right features, tokens and cache entries, after every kind of step."""
    target, head = oracle()
    for prompt in PROMPTS.values():
        req, steps = alone(target, prompt, greedy(61), [], DRAFTERS[name](head, target))
        steps = [len(tokens) for tokens in steps]
        assert req.output_ids == run(target, prompt, None, greedy(61)).output_ids
        if len(prompt) == 1:  # the first step only guesses the root again (no feature yet)
            steps = steps[1:]
        assert all(n == per_step for n in steps[:-1]), steps


def test_room_limits_the_tree(target: Transformer) -> None:
    """Near the end of the context the tree is cut to the room left, still a tree."""
    head = random_head(target)
    prompt = [(7 * i) % 96 for i in range(250)]  # context 256
    for name in ("eagle, paths only, wide", "eagle2, defaults"):
        spec = run(target, prompt, DRAFTERS[name](head, target), greedy(40))
        assert spec.output_ids == run(target, prompt, None, greedy(40)).output_ids


# ------------------------------------------------------------------------------------------------
# Sampling


N_SAMPLES = 1000  # per method: ~10 s each here; the liar below shows the check still has the power


@pytest.fixture(scope="module")
def small() -> tuple[Transformer, EagleHead, dict[tuple[int, ...], float]]:
    target, exact = small_target()
    return target, random_head(target, seed=3, std=0.5), exact


class UnconditionalLiar(EagleDrafter):
    """Draws siblings without replacement but declares the parent's whole q for each of them,
    as if they had been drawn independently: later siblings' acceptance is computed for the
    wrong distribution."""

    def propose(self, req: Request, budget: int | None = None) -> Proposal:
        tree = super().propose(req, budget).tree
        q = tree.draft_probs  # (N, V)
        if q is None:
            return Proposal(tree)
        parents = tree.parents.tolist()
        first = [parents.index(p) for p in parents]  # each node's eldest sibling: drawn from q itself
        return Proposal(DraftTree(tree.tokens, tree.parents, q[first]))


def with_vocab(head: EagleHead, ids: list[int]) -> EagleHead:
    """The same weights drafting from `ids` only."""
    other = EagleHead(head.layer_config, head.fc_bias, head.input_norm, draft_vocab=torch.tensor(ids))
    other.load_state_dict(head.state_dict())
    return other.eval()


SAMPLED: dict[str, Make] = {
    "eagle, wide tree": lambda h, t: EagleDrafter.static(h, t, [[0, 0], [1, 0], [2], [0, 1]]),
    "eagle2": lambda h, t: EagleDrafter.dynamic(h, t, depth=3, top_k=3, total_tokens=6),
    "eagle2, draft vocabulary of 5": lambda h, t: EagleDrafter.dynamic(
        with_vocab(h, [0, 2, 3, 5, 6]), t, depth=3, top_k=3, total_tokens=6
    ),
    "eagle2, budgeted to a chain of 2": lambda h, t: Budgeted(h, t, grow=(3, 3, 6)),
}


@pytest.mark.parametrize("name", SAMPLED)
def test_sampling_is_lossless(small: tuple, name: str) -> None:
    target, head, exact = small
    result, tau = sampled_check(target, exact, lambda: SAMPLED[name](head, target), N_SAMPLES)
    assert result.ok, (result, tau)
    # Drafts were accepted: the verifier really ran on them (a chain of 2 tries fewer tokens).
    assert tau > (1.05 if "chain" in name else 1.2)


def test_check_catches_siblings_declared_unconditionally(small: tuple) -> None:
    """The same check, with no more samples, flags siblings declared with the wrong q."""
    target, head, exact = small
    liar = lambda h, t: UnconditionalLiar(h, t, [[0], [1], [2], [3]])  # noqa: E731
    result, _ = sampled_check(target, exact, lambda: liar(head, target), N_SAMPLES)
    assert not result.ok, result


@pytest.mark.parametrize("name", ["eagle, paths only, wide", "eagle2, defaults"])
def test_a_budget_below_the_tree_drafts_its_best_chain(target: Transformer, name: str) -> None:
    """Given fewer draft tokens than its tree holds, a drafter proposes its top path, one token a
    depth (what the load policy's per-depth rates describe), no deeper than its tree."""
    head = random_head(target)
    make = DRAFTERS[name]
    depth = make(head, target).max_chain
    assert depth == 3  # the deepest path; EAGLE-2's depth
    best = propose_with_budget(EagleDrafter.dynamic(head, target, depth, 1, depth), target, None)
    assert best.parents.tolist() == [0, 1, 2]  # top_k 1: the head's greedy chain
    for budget in (1, 2, 3, 5):
        drafter = make(head, target)
        assert budget < drafter.max_nodes
        chain = propose_with_budget(drafter, target, budget)
        n = min(budget, depth)
        assert chain.parents.tolist() == list(range(n))
        assert chain.tokens.tolist() == best.tokens.tolist()[:n]
    whole = propose_with_budget(make(head, target), target, None)
    assert whole.num_nodes > depth and whole.parents.tolist() != list(range(whole.num_nodes))


def test_the_load_policy_weighs_a_tree_drafter_as_its_chain(target: Transformer) -> None:
    """The load policy weighs a tree drafter as deep as its chain (`max_chain`), not as many
    tokens as its tree holds, and what it grants is proposed as that chain: output unchanged."""
    from specdecode.engine.config import EngineConfig
    from specdecode.engine.llm_engine import EngineRequest, LLMEngine

    head = random_head(target)
    curve = ((1, 0.010), (2, 0.0101), (4, 0.0102), (8, 0.0103), (16, 0.03))  # rows nearly free
    engine = LLMEngine(target, EngineConfig(latency_curve=curve))
    assert engine.policy is not None
    weighed: list[int] = []
    budgets = engine.policy.budgets
    engine.policy.budgets = lambda c, base, most: (
        weighed.extend(x.max_draft for x in c),
        budgets(c, base, most),
    )[1]
    drafter = Recording(head, target, grow=(3, 3, 8))
    seq = engine.add_request(EngineRequest("a", PROMPTS["mixed"], greedy(24), None), drafter)
    while engine.has_unfinished():
        engine.step()
    assert seq.req.output_ids == run(target, PROMPTS["mixed"], None, greedy(24)).output_ids
    assert weighed and set(weighed) == {3}
    drafted = [t for t in drafter.trees if t.num_nodes > 1]
    assert drafted  # the policy granted drafts, each a chain of at most 3
    assert all(t.parents.tolist() == list(range(t.num_nodes)) and t.num_nodes <= 3 for t in drafted)


class Recording(EagleDrafter):
    """Keeps every tree it proposes."""

    trees: list[DraftTree]

    def propose(self, req: Request, budget: int | None = None) -> Proposal:
        proposal = super().propose(req, budget)
        self.__dict__.setdefault("trees", []).append(proposal.tree)
        return proposal


class Budgeted(EagleDrafter):
    """Proposes as the load policy makes it when it grants 2 tokens, below the tree: a chain."""

    def propose(self, req: Request, budget: int | None = None) -> Proposal:
        return super().propose(req, 2)


def test_sampled_siblings_declare_their_conditional_distribution(target: Transformer) -> None:
    """Sibling j's declared q excludes the j earlier siblings' tokens and gives its own token
    positive mass; rows sum to 1."""
    head = random_head(target)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=0)
    drafter = EagleDrafter.static(head, target, [[0], [1], [2], [0, 0], [0, 1]])
    req = Request(target, PROMPTS["mixed"], params, [], drafter.max_nodes)
    prefill(target, req)
    drafter.begin(req, run_prefix(target, req.prompt_ids))
    tree = drafter.propose(req).tree
    q = tree.draft_probs
    assert q is not None and tree.parents.tolist() == [0, 0, 0, 1, 1]
    torch.testing.assert_close(q.sum(-1), torch.ones(5))
    assert bool((q[torch.arange(5), tree.tokens] > 0).all())
    for later, earlier in ((1, [0]), (2, [0, 1]), (4, [3])):
        assert float(q[later, tree.tokens[earlier]].sum()) == 0.0


def run_prefix(model: Transformer, ids: list[int]) -> torch.Tensor:
    """The target's features of every prompt token but the last, (P-1, C)."""
    cache = model.new_cache(len(ids))
    with torch.inference_mode():
        return model(torch.tensor([ids[:-1]]), torch.arange(len(ids) - 1)[None], cache)[0]


# ------------------------------------------------------------------------------------------------
# Trees and settings


def test_both_choice_forms_build_the_same_tree(target: Transformer) -> None:
    head = random_head(target)
    every = [[0], [0, 0], [0, 0, 0], [0, 1], [0, 1, 0], [1], [1, 0], [1, 1]]
    paths = [[0, 0, 0], [0, 1, 0], [1, 0], [1, 1]]
    a = proposal(EagleDrafter.static(head, target, every), target, PROMPTS["mixed"]).tree
    b = proposal(EagleDrafter.static(head, target, paths), target, PROMPTS["mixed"]).tree
    assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
    assert a.num_nodes == 8


def test_dynamic_tree_keeps_the_most_probable_nodes(target: Transformer) -> None:
    """Greedy EAGLE-2 with top_k >= V at depth 1 keeps the total_tokens most likely first tokens."""
    head = random_head(target)
    drafter = EagleDrafter.dynamic(head, target, depth=1, top_k=96, total_tokens=5)
    tree = proposal(drafter, target, PROMPTS["mixed"]).tree
    assert drafter.last is not None
    best = drafter.draft_logits(drafter.last[None])[0].topk(5).indices
    assert tree.tokens.tolist() == best.tolist() and tree.parents.tolist() == [0] * 5


@pytest.mark.parametrize(
    "spec,words",
    [
        ({"method": "eagle2", "depth": 0}, "eagle2: depth must be a positive integer"),
        ({"method": "eagle2", "top_k": "8"}, "eagle2: top_k must be a positive integer"),
        ({"method": "eagle2", "total_tokens": -1}, "eagle2: total_tokens must be a positive integer"),
        ({"method": "eagle2", "eagle_choices": [[0]]}, "eagle2: unknown option eagle_choices"),
        ({"method": "eagle", "eagle_choices": [[0], []]}, "tree choice is empty"),
        ({"method": "eagle", "eagle_choices": [[0, -1]]}, "non-negative integer"),
        ({"method": "eagle", "eagle_choices": "[[0]]"}, "eagle: eagle_choices must be a list of lists"),
        ({"method": "eagle", "head": ""}, "eagle: head must be a path"),
        ({"method": "eagle", "depth": 3}, "eagle: unknown option depth"),
    ],
)
def test_bad_settings_name_the_setting(spec: dict, words: str) -> None:
    with pytest.raises(SpecDecodeError, match=words):
        parse_speculative(spec)


def test_settings_defaults_and_choice_ranks(target: Transformer) -> None:
    assert parse_speculative({"method": "eagle2"}) == Eagle2Config(depth=3, top_k=3, total_tokens=8)
    assert parse_speculative({"method": "eagle", "eagle_choices": [[0], [1, 0]]}) == EagleConfig(
        eagle_choices=((0,), (1, 0))
    )
    with pytest.raises(SpecDecodeError, match="rank 96, beyond the vocabulary of 96"):
        EagleDrafter.static(random_head(target), target, [[0], [96]])


def test_cli_flags() -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["generate", "--prompt", "x", "--top-k", "50", "--depth", "3", "--top-k-draft", "4", "--head", "H"]
    )
    assert speculative_settings(args) == {"method": "eagle2", "depth": 3, "top_k": 4, "head": "H"}
    assert args.top_k == 50  # sampling's top-k is its own flag
    args = parser.parse_args(
        ["generate", "--prompt", "x", "--method", "eagle", "--eagle-choices", "[[0],[1]]"]
    )
    assert speculative_settings(args) == {"method": "eagle", "eagle_choices": [[0], [1]]}


# ------------------------------------------------------------------------------------------------
# Checkpoints


def reference_state(head: EagleHead) -> dict[str, torch.Tensor]:
    """The head's weights named and shaped as in the EAGLE reference's checkpoints."""
    cfg = head.layer_config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    qkv = head.layer.qkv.weight_t.detach().t()  # (q + 2 kv, C)
    gate, up = head.layer.gate_up.weight_t.detach().t().chunk(2)
    a, p = "layers.0.self_attn.", "layers.0."
    state = {
        "fc.weight": head.fc.weight_t.detach().t(),
        a + "q_proj.weight": qkv[:q],
        a + "k_proj.weight": qkv[q : q + kv],
        a + "v_proj.weight": qkv[q + kv :],
        a + "o_proj.weight": head.layer.o.weight_t.detach().t(),
        p + "mlp.gate_proj.weight": gate,
        p + "mlp.up_proj.weight": up,
        p + "mlp.down_proj.weight": head.layer.down.weight_t.detach().t(),
        p + "post_attention_layernorm.weight": head.layer.mlp_norm.weight.detach(),
        "embed_tokens.weight": torch.zeros(cfg.vocab_size, cfg.hidden_size),  # ignored
    }
    if head.fc.bias is not None:
        state["fc.bias"] = head.fc.bias.detach()
    if cfg.attention_bias:
        bias = head.layer.qkv.bias.detach()  # type: ignore[union-attr]
        state.update(
            {
                a + "q_proj.bias": bias[:q],
                a + "k_proj.bias": bias[q : q + kv],
                a + "v_proj.bias": bias[q + kv :],
            }
        )
    return {k: v.contiguous().clone() for k, v in state.items()}


@pytest.mark.parametrize("file", ["model.safetensors", "pytorch_model.bin"])
def test_reference_layout_drafts_like_our_format(target: Transformer, tmp_path: Path, file: str) -> None:
    head = random_head(target)
    ours = save_head(head, tmp_path / "ours", target="tiny", dtype=torch.float32)
    ref = tmp_path / "ref"
    ref.mkdir()
    state = reference_state(head)
    if file.endswith(".bin"):
        torch.save(state, ref / file)
    else:
        from safetensors.torch import save_file

        save_file(state, str(ref / file))
    hf = target.config.to_hf()
    hf.update(num_hidden_layers=1, architectures=["LlamaForCausalLM"])
    (ref / "config.json").write_text(json.dumps(hf))
    a, b = load_head(ours), load_head(ref)
    assert b.fc_bias and not b.input_norm and b.layer_config.attention_bias == target.config.attention_bias
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name
    for make in (DRAFTERS["eagle, paths only, wide"], DRAFTERS["eagle2, defaults"]):
        ta = proposal(make(a, target), target, PROMPTS["mixed"]).tree
        tb = proposal(make(b, target), target, PROMPTS["mixed"]).tree
        assert ta.tokens.tolist() == tb.tokens.tolist() and ta.parents.tolist() == tb.parents.tolist()


def test_checkpoint_errors(target: Transformer, tmp_path: Path) -> None:
    with pytest.raises(SpecDecodeError, match="no such directory"):
        load_head(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecDecodeError, match="no EAGLE head in"):
        load_head(tmp_path / "empty")
    other = tiny_transformer(96, seed=1, hidden=48)
    save_head(random_head(other), tmp_path / "other", target="other")
    with pytest.raises(SpecDecodeError, match="trained for another target: hidden size 48"):
        EagleDrafter.static(load_head(tmp_path / "other"), target)
    drafters = DrafterFactory(target, model_name="no-such-model")
    with pytest.raises(SpecDecodeError, match="specdecode train eagle --model no-such-model"):
        drafters.head("eagle", None)


# ------------------------------------------------------------------------------------------------
# Training


def test_resumed_training_ends_where_an_uninterrupted_run_does(tiny_chat_dir: Path, tmp_path: Path) -> None:
    model = Transformer.from_dir(tiny_chat_dir)
    samples = random_samples(10, seed=4, low=2, high=6)
    feats = extract(
        model, samples, generate=True, max_len=40, eos_ids=[2], cache_dir=tmp_path / "f", model_tag="t",
        progress=False,
    )  # fmt: skip
    settings = TrainSettings(
        data="-", out=str(tmp_path), epochs=3, batch_size=4, save_every=2, dtype="float32", progress=False
    )

    def fresh() -> EagleHead:
        torch.manual_seed(0)
        return EagleHead.for_target(model.config)

    straight = check_resume_is_exact(
        lambda s: objective(fresh(), model, feats, s), settings, tmp_path, 4, ce_weight=0.5
    )
    assert not torch.equal(straight.fc.weight_t, fresh().fc.weight_t)


def teacher_forced(
    head: EagleHead, target: Transformer, tokens: torch.Tensor, feats: torch.Tensor
) -> torch.Tensor:
    """The head's teacher-forced outputs (B, T, C) over pairs (tokens (B, T), features (B, T, C))."""
    return torch.stack(
        [unroll_pairs(head, target.embed, tok, f, 1)[0] for tok, f in zip(tokens, feats, strict=True)]
    )


def test_loss_over_the_draft_vocabulary(target: Transformer) -> None:
    """The cross-entropy is a softmax over the draft vocabulary's columns; a label outside it is
    skipped, and a batch with only such labels still has a finite loss (the regression)."""
    torch.manual_seed(3)
    head = EagleHead.for_target(target.config)
    b, t, c = 2, 5, target.config.hidden_size
    tokens = torch.randint(0, target.config.vocab_size, (b, t))
    feats = torch.randn(b, t, c, dtype=torch.float16)
    nexts = torch.randn(b, t, c, dtype=torch.float16)
    vocab = torch.arange(0, target.config.vocab_size, 2)  # (V',) the even ids
    labels = torch.randint(0, vocab.numel(), (b, t))  # columns of the even ids
    labels[0, 1] = IGNORE
    trained = torch.ones(b, t, dtype=torch.bool)
    lm = target.head_weight_t().detach().float()  # (C, V)
    data = Batch(tokens, feats, nexts, labels, trained)
    loss, _ = eagle_loss(head, target.embed, lm[:, vocab], data, ce_weight=1.0, noise=0.0)

    with torch.no_grad():
        g = teacher_forced(head, target, tokens, feats.float())[trained]  # (P, C)
        regression = F.smooth_l1_loss(g, nexts[trained].float())
        logp = (g @ lm[:, vocab]).log_softmax(-1)  # (P, V')
        flat = labels[trained]
        kept = flat != IGNORE
        ce = -logp[kept.nonzero().squeeze(1), flat[kept]].mean()
    assert torch.allclose(loss.detach(), regression + ce, atol=1e-5)

    data.labels = torch.full((b, t), IGNORE)
    only_regression, _ = eagle_loss(head, target.embed, lm[:, vocab], data, ce_weight=1.0, noise=0.0)
    assert torch.isfinite(only_regression) and torch.allclose(only_regression.detach(), regression, atol=1e-5)


def test_rows_of_other_lengths_give_the_padded_batchs_loss(target: Transformer) -> None:
    """Each row runs over its own pairs only (no padding work), and the loss is that of the
    whole right-padded batch: causal attention never lets padding reach a real pair."""
    torch.manual_seed(4)
    head = EagleHead.for_target(target.config)
    b, t, c = 3, 7, target.config.hidden_size
    lengths = [7, 3, 5]
    tokens = torch.randint(0, target.config.vocab_size, (b, t))
    feats = torch.randn(b, t, c, dtype=torch.float16)
    nexts = torch.randn(b, t, c, dtype=torch.float16)
    labels = torch.randint(0, target.config.vocab_size, (b, t))
    trained = torch.arange(t)[None] < torch.tensor(lengths)[:, None]  # (B, T) real pairs only
    trained[0, 0] = False  # a prompt position
    lm = target.head_weight_t().detach().float()  # (C, V)
    rows = Batch(tokens, feats, nexts, labels, trained, lengths)
    short, _ = eagle_loss(head, target.embed, lm, rows, 0.5, 0.0)
    padded, _ = eagle_loss(head, target.embed, lm, Batch(tokens, feats, nexts, labels, trained), 0.5, 0.0)
    assert torch.allclose(short.detach(), padded.detach(), atol=1e-5)
    with torch.no_grad():
        g = teacher_forced(head, target, tokens, feats.float())[trained]  # (P, C)
        ce = F.cross_entropy(g @ lm, labels[trained])
        expected = F.smooth_l1_loss(g, nexts[trained].float()) + 0.5 * ce
    assert torch.allclose(short.detach(), expected, atol=1e-5)


def test_unrolled_steps_are_drafting_along_the_right_path(target: Transformer) -> None:
    """Step d of `unroll_pairs` from start t is what the drafter computes at depth d+1 after
    the true pairs 0..t: its own guesses fed back with the right tokens, one pair per step."""
    head = random_head(target, seed=5, std=0.05)
    n, steps, c = 6, 3, target.config.hidden_size
    torch.manual_seed(5)
    tokens = torch.randint(0, target.config.vocab_size, (n,))
    feats = torch.randn(n, c)
    with torch.no_grad():
        outs = unroll_pairs(head, target.embed, tokens, feats, steps)
        assert [o.shape[0] for o in outs] == [n, n - 1, n - 2]
        for t in range(n):
            cache = head.new_cache(n + steps, torch.float32, "cpu")
            g = head.run(cache, target.embed(tokens[: t + 1]), feats[: t + 1], torch.arange(t + 1))[-1]
            for d in range(min(steps, n - t)):
                assert torch.allclose(outs[d][t], g, atol=1e-5), (t, d)
                if t + d + 1 < n:
                    g = head.run(
                        cache, target.embed(tokens[t + d + 1 : t + d + 2]), g[None], torch.tensor([t + d + 1])
                    )[0]


def test_unrolled_loss_is_the_mean_of_the_steps_losses(target: Transformer) -> None:
    """`unroll` 3: each step is scored against the features and tokens it guesses (step d of
    start t: f_{t+1+d}, x_{t+2+d}) on trained positions only; the loss back-propagates through
    the steps (no tensor autograd saved is written again) into every weight of the head."""
    torch.manual_seed(6)
    head = random_head(target, seed=6, std=0.05).train()
    b, t, c = 2, 6, target.config.hidden_size
    lengths = [6, 4]
    tokens = torch.randint(0, target.config.vocab_size, (b, t))
    feats = torch.randn(b, t, c, dtype=torch.float16)
    nexts = torch.randn(b, t, c, dtype=torch.float16)
    labels = torch.randint(0, target.config.vocab_size, (b, t))
    trained = torch.arange(t)[None] < torch.tensor(lengths)[:, None]
    trained[0, 2] = False
    lm = target.head_weight_t().detach().float()
    loss, _ = eagle_loss(
        head, target.embed, lm, Batch(tokens, feats, nexts, labels, trained, lengths), 0.5, 0.0, unroll=3
    )
    loss.backward()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in head.parameters())
    with torch.no_grad():
        expected = []
        runs = [
            unroll_pairs(head, target.embed, tokens[i, :n], feats[i, :n].float(), 3)
            for i, n in enumerate(lengths)
        ]
        for d in range(3):
            at = [(i, j) for i, n in enumerate(lengths) for j in range(d, n) if trained[i, j]]
            g = torch.stack([runs[i][d][j - d] for i, j in at])  # (P, C)
            want = torch.stack([nexts[i, j] for i, j in at]).float()
            label = torch.stack([labels[i, j] for i, j in at])
            expected.append(F.smooth_l1_loss(g, want) + 0.5 * F.cross_entropy(g @ lm, label))
    assert torch.allclose(loss.detach(), torch.stack(expected).mean(), atol=1e-5)
    one, _ = eagle_loss(
        head, target.embed, lm, Batch(tokens, feats, nexts, labels, trained, lengths), 0.5, 0.0
    )
    assert torch.allclose(one.detach(), expected[0], atol=1e-5)


def test_train_command_end_to_end(
    tiny_chat_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`specdecode train eagle` on a tiny ShareGPT file: head, config (with a fitted tree) and
    report written, EAGLE-1 and EAGLE-2 with it decode exactly like plain greedy, and a second
    run needs --resume."""
    flags = ["--batch-size", "4", "--tree-nodes", "6", "--tree-depth", "3", "--draft-vocab", "40"]
    argv, out, printed, report = run_train_command("eagle", tiny_chat_dir, tmp_path, flags, capsys)
    assert "held-out top-1 accuracy of the drafted token by depth" in printed
    assert len(report["heldout_top1_by_depth"]) == 3
    assert report["heldout_tau_eagle"] >= 1.0 and report["heldout_tau_eagle2"] >= 1.0
    head = load_head(out)
    assert head.choices is not None and len(head.choices) == 6
    assert head.draft_vocab is not None and head.draft_vocab.numel() == 40
    assert 0 < report["draft_vocab_heldout_coverage"] <= 1

    specs = [{"method": "eagle", "head": str(out)}, {"method": "eagle2", "head": str(out), "depth": 3}]
    check_trained_run(tiny_chat_dir, argv, specs, capsys)

    # Fine-tuning starts from --init's weights and keeps its draft vocabulary (not --draft-vocab's).
    tuned = tmp_path / "tuned"
    assert argv[7] == str(out) and argv[-2:] == ["--draft-vocab", "40"]
    again = [*argv[:7], str(tuned), *argv[8:-1], "0", "--init", str(out), "--unroll", "2"]
    assert main([*again, "--max-steps", "0"]) == 0
    start = load_head(tuned)
    assert torch.equal(start.draft_vocab, head.draft_vocab)
    assert all(
        torch.equal(a, b)
        for a, b in zip(start.state_dict().values(), head.state_dict().values(), strict=True)
    )
    assert main([*again, "--resume", "--max-steps", "2"]) == 0
    moved = load_head(tuned)
    assert torch.equal(moved.draft_vocab, head.draft_vocab)
    assert not torch.equal(moved.fc.matrix(), head.fc.matrix())


# ------------------------------------------------------------------------------------------------
# The shipped head


@pytest.mark.real
def test_shipped_head_on_smollm2() -> None:
    """The shipped head loads by default for SmolLM2-135M and both trees decode exactly like
    plain greedy decoding, accepting drafts."""
    llm = LLM(model="smollm2-135m", progress=False, speculation_policy=False)  # whole trees
    ids = llm.chat_prompt([{"role": "user", "content": "Write a short poem about the sea."}])
    params = SamplingParams(max_tokens=32, temperature=0)
    plain = llm.generate([ids], params)[0].token_ids
    for method in ("eagle", "eagle2"):
        spec = llm.generate([ids], params, speculative={"method": method})[0]
        assert spec.token_ids == plain, method
        assert spec.stats.mean_accepted_length > 1.3, method
