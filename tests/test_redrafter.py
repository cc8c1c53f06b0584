"""ReDrafter: beams merged into one tree (table-driven), beam search against exhaustive search,
greedy output equal to plain greedy decoding (random and trained drafters, several beam shapes,
width 1 included), losslessness under sampling (and a wrong q caught), settings and checkpoint
errors, Apple's reference layout drafting like our format, the training loop's resume, the
`specdecode train redrafter` command, and the shipped drafter on the real model (`real`).

The sampling test runs the real engine, one `Request` (own seed) per sample, on a tiny target
with an 8-token vocabulary and compares 3-token generations with the exact distribution, using
the chi-square + total-variation check of tests/test_draft_model.py.
"""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from specdecode.cli import build_parser, main, speculative_settings
from specdecode.drafters.base import Proposal
from specdecode.drafters.redrafter import (
    ReDrafter,
    ReDrafterHead,
    beam_search,
    check_fits,
    load_head,
    merge_beams,
    save_head,
)
from specdecode.engine.drafter_factory import DrafterFactory
from specdecode.errors import SpecDecodeError
from specdecode.layers import dense_linears
from specdecode.layers.linear import Dense
from specdecode.llm import LLM
from specdecode.models.transformer import Transformer
from specdecode.request import Request
from specdecode.sampling import SamplingParams, logits_to_probs
from specdecode.spec_config import ReDrafterConfig, parse_speculative
from specdecode.train.data import Sample
from specdecode.train.features import extract
from specdecode.train.pipeline import draft_columns, train_loop
from specdecode.train.redrafter import TrainSettings, drafter_logits, objective, positions, top1_by_depth
from specdecode.tree import DraftTree
from tests.alone import exact_greedy, greedy, prefill, proposal, run, tau
from tests.test_draft_model import sampled_check, small_target
from tests.test_draft_model import tiny_transformer as small_transformer
from tests.test_train import check_resume_is_exact, check_trained_run, own_continuations, run_train_command
from tests.tiny import randomized

pytestmark = pytest.mark.usefixtures("one_thread")


def random_head(model: Transformer, seed: int = 0, std: float = 0.3, **kwargs: object) -> ReDrafterHead:
    """A drafter that drafts something other than the target's next token."""
    c, v = model.config.hidden_size, model.config.vocab_size
    return randomized(lambda: ReDrafterHead(c, v, **kwargs), seed, std)  # type: ignore[arg-type]


PROMPTS = {
    "repetitive": [10, 11, 12, 13, 14, 15] * 5,
    "mixed": [5, 6, 7, 40, 41, 5, 6, 7, 90, 3, 5, 6],
    "counting": list(range(20, 50)),
    "one token": [93],
}


# ------------------------------------------------------------------------------------------------
# Beams and the tree


@pytest.mark.parametrize(
    ("beams", "tokens", "parents"),
    [
        pytest.param([[5, 6, 7]], [5, 6, 7], [0, 1, 2], id="one beam: a chain"),
        pytest.param([[5, 6, 7], [5, 6, 8]], [5, 6, 7, 8], [0, 1, 2, 2], id="split at the last"),
        pytest.param([[5, 6, 7], [5, 8], [9]], [5, 9, 6, 8, 7], [0, 0, 1, 1, 3], id="docstring example"),
        pytest.param(
            [[1, 2], [3, 2], [1, 4], [3, 4]],
            [1, 3, 2, 2, 4, 4],
            [0, 0, 1, 2, 1, 2],
            id="same tokens, other prefixes",
        ),
        pytest.param([[4, 4], [4, 4]], [4, 4], [0, 1], id="duplicate beams"),
        pytest.param([], [], [], id="no beams"),
    ],
)
def test_merge_beams(beams: list[list[int]], tokens: list[int], parents: list[int]) -> None:
    got_tokens, got_parents = merge_beams(beams)
    assert (got_tokens, got_parents) == (tokens, parents)
    if tokens:  # every beam is a root-to-node path of the tree
        tree = DraftTree(torch.tensor(got_tokens), torch.tensor(got_parents))
        paths = {
            tuple(int(tree.tokens[n - 1]) for n in p[: d + 1]) for p in tree.paths() for d in range(len(p))
        }
        assert all(tuple(b) in paths for b in beams)
        assert len(paths) == len(tokens)  # one node per distinct prefix


def test_beam_search_is_exhaustive_when_wide_enough() -> None:
    """With width >= V^(depth-1) nothing is pruned, so the beams are exactly the `width` best
    sequences over all V^depth by the teacher-forced scores the training loss uses."""
    model = small_transformer(8, seed=4, hidden=16, std=0.5)
    head = random_head(model, seed=2, std=0.5)
    context = torch.randn(16)
    root, depth, width = 3, 3, 64
    emb, lm = model.embed.weight.detach(), model.head_weight_t()
    beams, scores = beam_search(head, context, root, model.embed, lm, width, depth)
    every = torch.tensor(list(itertools.product(range(8), repeat=depth)))  # (512, D)
    fed = torch.cat([torch.full((every.shape[0], 1), root), every[:, :-1]], dim=1)  # (512, D)
    with torch.no_grad():
        logp = torch.log_softmax(drafter_logits(head, context.expand(512, 16), fed, emb, lm), -1)
    total = logp.gather(-1, every[..., None]).squeeze(-1).sum(-1)  # (512,)
    best = total.topk(width)
    assert torch.equal(beams, every[best.indices])
    torch.testing.assert_close(scores, best.values)


def test_beam_width_one_is_the_drafters_greedy_chain(target: Transformer) -> None:
    head = random_head(target)
    context = torch.randn(target.config.hidden_size)
    emb, lm = target.embed.weight.detach(), target.head_weight_t()
    beams, _ = beam_search(head, context, 7, target.embed, lm, 1, 4)
    chain, state, last = [], torch.zeros(1, target.config.hidden_size), torch.tensor([7])
    with torch.no_grad():
        for _ in range(4):
            state = head.step(state, emb[last])
            last = head(context[None], state, lm).argmax(-1)
            chain.append(int(last))
    assert beams.tolist() == [chain]


def test_a_budget_below_the_tree_searches_one_beam(target: Transformer) -> None:
    """Given fewer draft tokens than its beams hold, the drafter searches one beam (its greedy
    chain), no longer than a beam."""
    head = random_head(target)
    best = proposal(ReDrafter(head, target, 1, 4), target, PROMPTS["mixed"]).tree  # 3 tokens
    assert best.parents.tolist() == [0, 1, 2]
    for budget in (1, 2, 3, 5):
        drafter = ReDrafter(head, target, 3, 4)
        assert drafter.max_chain == 3 and budget < drafter.max_nodes
        req = Request(target, PROMPTS["mixed"], greedy(8), [], drafter.max_nodes)
        drafter.begin(req, prefill(target, req))
        chain = drafter.propose(req, budget).tree
        n = min(budget, 3)
        assert chain.parents.tolist() == list(range(n))
        assert chain.tokens.tolist() == best.tokens.tolist()[:n]


# ------------------------------------------------------------------------------------------------
# Greedy equality


@pytest.mark.parametrize(("width", "length"), [(1, 2), (1, 5), (3, 3), (4, 5)])
def test_greedy_equals_plain_greedy_with_a_random_drafter(
    target: Transformer, width: int, length: int
) -> None:
    head = random_head(target)
    for name, prompt in PROMPTS.items():
        plain = run(target, prompt, None, greedy())
        drafter = ReDrafter(head, target, width, length)
        spec = run(target, prompt, drafter, greedy())
        assert spec.output_ids == plain.output_ids, name
        assert spec.stats.num_draft_tokens > 0
        assert drafter.max_nodes == width * (length - 1)


def test_draft_vocabulary(target: Transformer, tmp_path: Path) -> None:
    """A drafter restricted to K tokens drafts only those, as the K best of the full softmax
    would order them, survives a save/load, and leaves greedy output exact."""
    head = random_head(target)
    context = torch.randn(target.config.hidden_size)
    lm = target.head_weight_t()
    full, _ = beam_search(head, context, 7, target.embed, lm, 1, 3)
    head.draft_vocab = torch.tensor(
        sorted({*range(0, 96, 3), *full[0].tolist()})
    )  # holds the full-vocab chain
    small, _ = beam_search(head, context, 7, target.embed, lm, 1, 3)
    assert torch.equal(small, full)  # the argmax over a subset that holds it is the same
    wide, _ = beam_search(head, context, 7, target.embed, lm, 6, 4)
    assert set(wide.flatten().tolist()) <= set(head.draft_vocab.tolist())
    save_head(head, tmp_path / "h", target="tiny", dtype=torch.float32)
    loaded = load_head(tmp_path / "h")
    assert torch.equal(loaded.draft_vocab, head.draft_vocab) and loaded.config()["draft_vocab_size"] >= 32
    for prompt in PROMPTS.values():
        spec = run(target, prompt, ReDrafter(loaded, target, 4, 4), greedy())
        assert spec.output_ids == run(target, prompt, None, greedy()).output_ids
    with pytest.raises(SpecDecodeError, match="needs the shared LM head"):
        ReDrafterHead(target.config.hidden_size, 96, shared_lm_head=False, exit_dim=128, draft_vocab_size=8)


def test_own_lm_head_and_no_rnn_variants(target: Transformer) -> None:
    """The reference's layouts: own LM head with exit_dim 2C (no projection), and rnn False."""
    c = target.config.hidden_size
    for kwargs in ({"exit_dim": 2 * c, "shared_lm_head": False}, {"rnn": False}):
        head = random_head(target, **kwargs)
        prompt = PROMPTS["mixed"]
        spec = run(target, prompt, ReDrafter(head, target, 3, 4), greedy())
        assert spec.output_ids == run(target, prompt, None, greedy()).output_ids


def test_the_factory_runs_the_blocks_through_the_kernels(target: Transformer, tmp_path: Path) -> None:
    """`dense_linears` puts a `Dense` with the same weights in place of each torch Linear of a head
    (the same features, steps and logits); the drafter factory does so before binding the
    kernels, so a head it loads has none left, and output stays plain decoding's."""
    c = target.config.hidden_size
    head = random_head(target, shared_lm_head=False, exit_dim=3 * c // 2)  # a projection, its own head
    converted = copy.deepcopy(head)
    dense_linears(converted)
    assert not any(isinstance(m, nn.Linear) for m in converted.modules())
    assert sum(isinstance(m, Dense) for m in converted.modules()) == 6  # rnn 2, proj, 2 blocks, head
    context, state, embedding = torch.randn(3, c), torch.randn(3, c), torch.randn(3, c)
    near = {"rtol": 1e-3, "atol": 1e-3}  # the same products, summed in another order
    torch.testing.assert_close(converted(context, state), head(context, state), **near)
    torch.testing.assert_close(converted.step(state, embedding), head.step(state, embedding), **near)
    save_head(head, tmp_path / "h", target="tiny", dtype=torch.float32)
    loaded = DrafterFactory(target).head("redrafter", str(tmp_path / "h"))
    assert not any(isinstance(m, nn.Linear) for m in loaded.modules())
    for prompt in PROMPTS.values():
        spec = run(target, prompt, ReDrafter(loaded, target, 3, 4), greedy())
        assert spec.output_ids == run(target, prompt, None, greedy()).output_ids


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Transformer, ReDrafterHead]:
    """A tiny target and a drafter fitted (a few seconds) to the target's own greedy
    continuations of PROMPTS: an oracle for exactly the rows decoding shows it. This checks
    that training and drafting agree on what the drafter reads (the row that produced the root,
    the root fed first, then each beam's tokens): otherwise its guesses would not be accepted."""
    out = tmp_path_factory.mktemp("redrafter_trained")
    model, feats = own_continuations(out, list(PROMPTS.values()))
    settings = TrainSettings(
        data="-", out=str(out), depth=3, epochs=150, lr=1e-2, batch_size=64, progress=False
    )
    head = ReDrafterHead(model.config.hidden_size, model.config.vocab_size, num_layers=1)
    embedding, lm_weight = model.embed.weight.detach(), model.head_weight_t().detach()
    train_loop(objective(head, embedding, lm_weight, positions(feats, 3), settings), out / "s.pt")
    return model, head


def test_trained_drafter_accepts_and_stays_exact(trained: tuple[Transformer, ReDrafterHead]) -> None:
    model, head = trained
    runs = [exact_greedy(model, prompt, ReDrafter(head, model, 2, 4), 80) for prompt in PROMPTS.values()]
    assert tau(runs) > 3.0, tau(runs)  # 4 = every draft token accepted


def test_room_limits_the_tree(target: Transformer) -> None:
    """Near the end of the context the merged tree is cut to the room left; output is unchanged."""
    head = random_head(target)
    long_prompt = [(7 * i) % 96 for i in range(250)]  # context 256
    req = run(target, long_prompt, ReDrafter(head, target, 4, 5), greedy(40))
    assert req.output_ids == run(target, long_prompt, None, greedy(40)).output_ids
    assert len(req.output_ids) == 6


# ------------------------------------------------------------------------------------------------
# Sampling: the distribution of generated sequences


@pytest.fixture(scope="module")
def small() -> tuple[Transformer, ReDrafterHead, dict[tuple[int, ...], float]]:
    target, exact = small_target()
    head = random_head(target, seed=1, std=0.2)  # beams that split at depth 1: tau ~1.3
    return target, head, exact


class ClaimsDrafterSoftmax(ReDrafter):
    """Picks tokens by beam search (deterministic) but reports the drafter's softmax at each
    node's parent as the distribution the node was drawn from: the verifier's acceptance test
    and residual are then wrong."""

    def propose(self, req: Request, budget: int | None = None) -> Proposal:
        tree = super().propose(req, budget).tree
        if self.hidden is None or tree.num_nodes == 0:
            return Proposal(tree)
        emb, lm = self.target.embed.weight, self.target.head_weight_t()
        q = torch.zeros(tree.num_nodes, self.head.vocab_size)
        states = [torch.zeros(self.head.hidden_size)]  # index 0: the root's parent state
        fed = [req.root]
        with torch.inference_mode():
            for i, parent in enumerate(tree.parents.tolist()):
                state = self.head.step(states[parent], emb[fed[parent]])
                q[i] = logits_to_probs(self.head(self.hidden, state, lm), req.params)
                states.append(state)
                fed.append(int(tree.tokens[i]))
        return Proposal(DraftTree(tree.tokens, tree.parents, q))


def test_sampling_is_lossless(small: tuple[Transformer, ReDrafterHead, dict]) -> None:
    target, head, exact = small
    result, mean_tau = sampled_check(target, exact, lambda: ReDrafter(head, target, 2, 3), 2500)
    assert result.ok, result
    assert mean_tau > 1.1, mean_tau  # the drafts were used and often accepted


def test_check_catches_the_drafters_softmax_as_q(small: tuple[Transformer, ReDrafterHead, dict]) -> None:
    target, head, exact = small
    result, _ = sampled_check(target, exact, lambda: ClaimsDrafterSoftmax(head, target, 2, 3), 1500)
    assert not result.ok, result
    assert result.p_value < 1e-6, result


# ------------------------------------------------------------------------------------------------
# Settings, checkpoints


BAD = [
    ({"method": "redrafter", "beam_width": 0}, "beam_width must be a positive integer"),
    ({"method": "redrafter", "beam_width": True}, "beam_width must be a positive integer"),
    ({"method": "redrafter", "beam_length": 1}, "beam_length must be >= 2"),
    ({"method": "redrafter", "beam_length": 2.5}, "beam_length must be a positive integer"),
    ({"method": "redrafter", "head": ""}, "head must be a path"),
    ({"method": "redrafter", "heads": "x"}, "unknown option heads"),
]


@pytest.mark.parametrize(("spec", "words"), BAD, ids=[str(b[0]) for b in BAD])
def test_bad_settings_name_the_setting(spec: dict, words: str) -> None:
    with pytest.raises(SpecDecodeError) as err:
        parse_speculative(spec)
    assert words in str(err.value)


def test_settings_and_cli_flags() -> None:
    spec = parse_speculative({"method": "redrafter", "beam_length": 4})
    assert spec == ReDrafterConfig(head=None, beam_width=2, beam_length=4)
    args = build_parser().parse_args(["generate", "--prompt", "x", "--beam-width", "3", "--head", "/d"])
    assert speculative_settings(args) == {"method": "redrafter", "head": "/d", "beam_width": 3}
    args = build_parser().parse_args(
        ["generate", "--prompt", "x", "--method", "medusa", "--beam-length", "3"]
    )
    with pytest.raises(SpecDecodeError, match="unknown option beam_length"):
        parse_speculative(speculative_settings(args))


def reference_dir(head: ReDrafterHead, out: Path, kind: str) -> Path:
    """`head` written as apple/ml-recurrent-drafter's `save_pretrained` would: its config and
    `lm_head` = Sequential(ResBlock * L, Linear(E, V)) naming."""
    from safetensors.torch import save_file

    assert head.lm_head is not None
    state = {}
    for name, tensor in head.state_dict().items():
        if name == "draft_vocab":  # ours only
            continue
        if name.startswith("blocks."):
            name = "lm_head." + name.removeprefix("blocks.")
        elif name == "lm_head.weight":
            name = f"lm_head.{head.num_layers}.weight"
        state[name] = tensor.detach().clone()
    out.mkdir()
    config = {
        "model_type": "recurrent_drafting_drafter", "vocab_size": head.vocab_size,
        "hidden_size": head.hidden_size, "exit_dim": head.exit_dim, "num_draft_layers": head.num_layers,
        "num_lookback_tokens": 1, "rnn": head.rnn, "torch_dtype": "float32",
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    if kind == "safetensors":
        save_file(state, str(out / "model.safetensors"))
    else:
        torch.save(state, out / "pytorch_model.bin")
    return out


@pytest.mark.parametrize("exit_dim", ["2C", "C"])
def test_reference_layout_drafts_like_our_format(target: Transformer, tmp_path: Path, exit_dim: str) -> None:
    c = target.config.hidden_size
    head = random_head(target, seed=5, exit_dim=2 * c if exit_dim == "2C" else c, shared_lm_head=False)
    assert (head.input_proj is None) == (exit_dim == "2C")
    save_head(head, tmp_path / "ours", target="tiny", dtype=torch.float32)
    reference_dir(head, tmp_path / "safetensors", "safetensors")
    reference_dir(head, tmp_path / "bin", "bin")
    loaded = {name: load_head(tmp_path / name) for name in ("ours", "safetensors", "bin")}
    prompt = PROMPTS["mixed"]
    trees = {}
    for name, h in loaded.items():
        trees[name] = proposal(ReDrafter(h, target, 4, 4), target, prompt).tree
    for name in ("safetensors", "bin"):
        assert not loaded[name].shared_lm_head
        assert torch.equal(trees[name].tokens, trees["ours"].tokens), name
        assert torch.equal(trees[name].parents, trees["ours"].parents), name
    assert trees["ours"].num_nodes > 4  # beams that split
    outs = {name: run(target, prompt, ReDrafter(h, target, 4, 4), greedy(32)) for name, h in loaded.items()}
    assert outs["ours"].output_ids == outs["bin"].output_ids == outs["safetensors"].output_ids
    assert outs["ours"].stats == outs["bin"].stats == outs["safetensors"].stats


def test_checkpoint_errors(target: Transformer, tmp_path: Path) -> None:
    cfg = target.config
    with pytest.raises(SpecDecodeError, match="trained for another target: hidden size 32"):
        check_fits(ReDrafterHead(32, cfg.vocab_size), target)
    with pytest.raises(SpecDecodeError, match="vocabulary 100"):
        ReDrafter(ReDrafterHead(cfg.hidden_size, 100), target, 2, 3)
    with pytest.raises(SpecDecodeError, match="beam_length >= 2"):
        ReDrafter(ReDrafterHead(cfg.hidden_size, cfg.vocab_size), target, 2, 1)
    with pytest.raises(SpecDecodeError, match="exit_dim = hidden size"):
        ReDrafterHead(cfg.hidden_size, cfg.vocab_size, exit_dim=2 * cfg.hidden_size)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecDecodeError, match="no ReDrafter in"):
        load_head(tmp_path / "empty")
    with pytest.raises(SpecDecodeError, match="no such directory"):
        load_head(tmp_path / "missing")
    head = random_head(target, shared_lm_head=False)
    broken = reference_dir(head, tmp_path / "broken", "safetensors")
    (broken / "config.json").write_text(json.dumps({"model_type": "recurrent_drafting_drafter"}))
    with pytest.raises(SpecDecodeError, match="not a ReDrafter config"):
        load_head(broken)


# ------------------------------------------------------------------------------------------------
# Training


def test_positions_feed_the_root_then_the_labels() -> None:
    """Position t: x_{t+1} is fed first; label k is x_{t+1+k} while the assistant wrote t+2..t+1+k."""
    from specdecode.train.features import Features
    from specdecode.train.medusa import IGNORE

    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7])
    mask = torch.tensor([False, False, True, True, False, True, True])
    hidden = torch.arange(6, dtype=torch.float16)[:, None].expand(6, 2)  # row t holds t
    data = positions(Features([ids, ids], [mask, mask], [hidden, hidden]), depth=3)
    i = IGNORE
    expected = [[2, 3, 4, i], [3, 4, i, i], [5, 6, 7, i], [6, 7, i, i]]  # t = 0, 1, 3, 4
    assert data.tokens.tolist() == expected * 2
    assert data.rows.tolist() == [0, 1, 3, 4, 6, 7, 9, 10]  # the second sample's rows follow the first's
    assert data.hidden[data.rows, 0].tolist() == [0, 1, 3, 4] * 2


def test_draft_vocabulary_columns_in_training() -> None:
    """`draft_columns` keeps the vocabulary's columns and maps token ids to them (IGNORE outside);
    measured accuracy counts a token outside the vocabulary as missed."""
    from specdecode.train.medusa import IGNORE
    from specdecode.train.redrafter import Positions

    lm = torch.arange(12.0).view(2, 6)  # (C, V)
    cols, column = draft_columns(lm, torch.tensor([1, 4]))
    assert cols.tolist() == [[1.0, 4.0], [7.0, 10.0]] and column is not None
    assert column.tolist() == [IGNORE, 0, IGNORE, IGNORE, 1, IGNORE]
    assert draft_columns(lm, None)[1] is None
    assert draft_columns(lm, torch.empty(0, dtype=torch.long))[0].data_ptr() == lm.data_ptr()  # no copy
    with torch.inference_mode():
        cached = torch.ones(2, 6)  # a cached tied head is made under inference mode
    assert not draft_columns(cached, None)[0].is_inference()  # autograd can use it

    torch.manual_seed(0)
    head = ReDrafterHead(2, 6, num_layers=0)
    emb = torch.randn(6, 2)
    data = Positions(torch.randn(3, 2), torch.arange(3), torch.tensor([[0, 1], [0, 4], [0, 2]]))
    logits = drafter_logits(head, data.hidden, data.tokens[:, :1], emb, lm)[:, 0]  # (3, V)
    full = top1_by_depth(head, emb, lm, data)[0]
    assert full == pytest.approx(float((logits.argmax(-1) == data.tokens[:, 1]).float().mean()))
    head.draft_vocab = torch.tensor([1, 4])
    inside = logits[:, [1, 4]].argmax(-1)  # (3,) columns
    expected = ((inside == 0) & (data.tokens[:, 1] == 1)) | ((inside == 1) & (data.tokens[:, 1] == 4))
    assert top1_by_depth(head, emb, lm, data)[0] == pytest.approx(float(expected.float().mean()))


def test_resumed_training_ends_where_an_uninterrupted_run_does(tiny_chat_dir: Path, tmp_path: Path) -> None:
    model = Transformer.from_dir(tiny_chat_dir)
    samples = [Sample(p, [True] * len(p), 1) for p in PROMPTS.values()]
    feats = extract(
        model, samples, generate=False, max_len=64, eos_ids=[], cache_dir=tmp_path / "f", model_tag="t",
        progress=False,
    )  # fmt: skip
    data = positions(feats, 3)
    settings = TrainSettings(
        data="-", out=str(tmp_path), depth=3, distill=0.5, epochs=3, batch_size=16, lr=3e-3, save_every=4,
        progress=False,
    )  # fmt: skip
    emb, lm = model.embed.weight.detach(), model.head_weight_t().detach()

    def new_head() -> ReDrafterHead:
        torch.manual_seed(0)
        return ReDrafterHead(model.config.hidden_size, model.config.vocab_size, num_layers=1)

    straight = check_resume_is_exact(
        lambda s: objective(new_head(), emb, lm, data, s), settings, tmp_path, 5, distill=0.0
    )
    assert not torch.equal(straight.rnn_w.weight, new_head().rnn_w.weight)


def test_train_command_end_to_end(
    tiny_chat_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`specdecode train redrafter` on a tiny ShareGPT file: drafter, config and report written,
    the drafter decodes exactly like plain greedy, and a second run needs --resume."""
    flags = [
        "--depth",
        "3",
        "--num-layers",
        "1",
        "--batch-size",
        "64",
        "--beam-width",
        "2",
        "--draft-vocab",
        "20",
    ]
    argv, out, printed, report = run_train_command("redrafter", tiny_chat_dir, tmp_path, flags, capsys)
    assert "held-out top-1 accuracy per depth" in printed
    assert len(report["heldout_top1"]) == 3 and report["heldout_tau"] >= 1.0
    head = load_head(out)
    assert head.num_layers == 1 and head.shared_lm_head and head.draft_vocab.numel() == 20
    assert 0.5 < report["heldout_draft_vocab_coverage"] <= 1.0
    assert (out / "redrafter.safetensors").stat().st_size < 100_000  # shared LM head: no V x C matrix

    check_trained_run(tiny_chat_dir, argv, [{"method": "redrafter", "head": str(out)}], capsys)
    assert main([*argv, "--distill", "1.5"]) == 2
    assert "--distill must be in [0, 1]" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# The shipped drafter on the real model


@pytest.mark.real
def test_shipped_drafter_on_smollm2() -> None:
    spec = {"method": "redrafter"}
    llm = LLM(model="smollm2-135m", speculative=spec, progress=False, speculation_policy=False)
    params = SamplingParams(max_tokens=48, temperature=0)
    ids = llm.chat_prompt([{"role": "user", "content": "Write a short poem about the sea."}])
    spec = llm.generate([ids], params)[0]
    plain = llm.generate([ids], params, speculative=None)[0]
    assert spec.token_ids == plain.token_ids
    assert spec.stats.mean_accepted_length >= 1.3, spec.stats.mean_accepted_length
