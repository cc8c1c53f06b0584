"""The one transformer against transformers' implementation, tree attention, rollback, compaction."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdecode.attention import tree_mask
from specdecode.kv_cache import moved
from specdecode.models.transformer import Transformer
from specdecode.tree import DraftTree

torch.manual_seed(0)


def load_pair(path: Path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf, Transformer.from_dir(path)


def full_logits(model: Transformer, ids: list[int]) -> torch.Tensor:
    """Logits (T, V) of a fresh causal forward of `ids`."""
    cache = model.new_cache(len(ids) + 8)
    with torch.inference_mode():
        return model.logits(model(torch.tensor([ids]), torch.arange(len(ids))[None], cache)[0])


def test_logits_match_transformers(tiny_model_dir: Path) -> None:
    hf, ours = load_pair(tiny_model_dir)
    ids = torch.randint(0, 96, (1, 33))
    with torch.inference_mode():
        ref = hf(ids).logits[0]
    torch.testing.assert_close(full_logits(ours, ids[0].tolist()), ref, atol=1e-4, rtol=1e-4)


def test_greedy_matches_transformers_generate(tiny_model_dir: Path) -> None:
    from specdecode.sampling import SamplingParams
    from tests.alone import alone

    hf, ours = load_pair(tiny_model_dir)
    for prompt in ([5, 6, 7], [11, 40, 2, 77, 31, 9, 9, 9], list(range(10, 50))):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=2)
        expected = ref[0, len(prompt) :].tolist()
        if 2 in expected:  # transformers pads after the end-of-sequence token
            expected = expected[: expected.index(2) + 1]
        req, steps = alone(ours, prompt, SamplingParams(max_tokens=40, temperature=0), [2])
        list(steps)
        assert req.output_ids == expected


def random_tree(n: int, vocab: int, gen: torch.Generator) -> DraftTree:
    parents = [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n + 1)]
    tokens = torch.randint(0, vocab, (n,), generator=gen)
    return DraftTree(tokens, torch.tensor(parents, dtype=torch.long))


def root_path(tree: DraftTree, node: int) -> list[int]:
    """Node indices from the root (0) to `node`."""
    path = [node]
    while path[-1] != 0:
        path.append(int(tree.parents[path[-1] - 1]))
    return path[::-1]


@pytest.mark.parametrize("num_nodes", [1, 5, 12])
def test_tree_forward_equals_causal_forward_of_each_path(tiny_model_dir: Path, num_nodes: int) -> None:
    model = Transformer.from_dir(tiny_model_dir)
    gen = torch.Generator().manual_seed(num_nodes)
    prefix = torch.randint(0, 96, (17,), generator=gen).tolist()
    tree = random_tree(num_nodes, 96, gen)
    root = 42
    cache = model.new_cache(64)
    with torch.inference_mode():
        model(torch.tensor([prefix]), torch.arange(17)[None], cache)
        ids = torch.cat([torch.tensor([root]), tree.tokens])
        hidden = model(ids[None], (17 + tree.depths())[None], cache, tree_mask(17, tree.ancestor_mask()))
        tree_logits = model.logits(hidden[0])  # (N+1, V)
    all_tokens = [root, *tree.tokens.tolist()]
    for node in range(num_nodes + 1):
        path_tokens = [all_tokens[i] for i in root_path(tree, node)]
        expected = full_logits(model, prefix + path_tokens)[-1]
        torch.testing.assert_close(tree_logits[node], expected, atol=1e-4, rtol=1e-4)


def test_rollback_leaves_cache_as_a_fresh_forward(tiny_model_dir: Path) -> None:
    model = Transformer.from_dir(tiny_model_dir)
    ids = torch.randint(0, 96, (30,)).tolist()
    cache = model.new_cache(64)
    with torch.inference_mode():
        model(torch.tensor([ids[:20]]), torch.arange(20)[None], cache)
        model(torch.tensor([ids[20:]]), torch.arange(20, 30)[None], cache)  # 10 tokens then forgotten
        cache.rollback(10)
        assert cache.length == 20
        nxt = model.logits(model(torch.tensor([[7]]), torch.tensor([[20]]), cache)[0, -1])
    torch.testing.assert_close(nxt, full_logits(model, [*ids[:20], 7])[-1], atol=1e-4, rtol=1e-4)


def test_compaction_keeps_exactly_the_accepted_path(tiny_model_dir: Path) -> None:
    model = Transformer.from_dir(tiny_model_dir)
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 96, (9,), generator=gen).tolist()
    tree = random_tree(10, 96, gen)
    leaf = tree.num_nodes  # the last node: its path is usually not a prefix of the input order
    path = root_path(tree, leaf)
    all_tokens = [13, *tree.tokens.tolist()]
    cache = model.new_cache(64)
    with torch.inference_mode():
        model(torch.tensor([prefix]), torch.arange(9)[None], cache)
        ids = torch.tensor(all_tokens)
        model(ids[None], (9 + tree.depths())[None], cache, tree_mask(9, tree.ancestor_mask()))
        cache.compact(9, path)
        assert cache.length == 9 + len(path)
        kept = prefix + [all_tokens[i] for i in path]
        fresh = model.new_cache(64)
        model(torch.tensor([kept]), torch.arange(len(kept))[None], fresh)
    torch.testing.assert_close(cache.k[:, :, :, : cache.length], fresh.k[:, :, :, : fresh.length])
    torch.testing.assert_close(cache.v[:, :, :, : cache.length], fresh.v[:, :, :, : fresh.length])


def test_moved_sees_a_path_already_in_place() -> None:
    """A compaction's offsets 0..M-1 (a chain accepted from its root) move nothing; others are
    gathered, as a list or a tensor."""
    cpu = torch.device("cpu")
    for keep in ([], [0], [0, 1, 2], torch.tensor([0, 1]), torch.zeros(0, dtype=torch.long)):
        assert moved(keep, cpu) is None
    for keep in ([1], [0, 2], torch.tensor([0, 3])):
        got = moved(keep, cpu)
        assert got is not None and got.dtype == torch.long and got.tolist() == list(keep)


def test_bfloat16_runs_and_stays_close(tiny_model_dir: Path) -> None:
    f32 = Transformer.from_dir(tiny_model_dir)
    bf16 = Transformer.from_dir(tiny_model_dir, dtype=torch.bfloat16)
    assert bf16.embed.weight.dtype == torch.bfloat16
    ids = list(range(3, 20))
    a, b = full_logits(f32, ids), full_logits(bf16, ids)
    assert b.dtype == torch.float32
    assert (a.softmax(-1) - b.softmax(-1)).abs().max() < 0.05


def test_screened_greedy_tokens_equal_full_argmax(tiny_model_dir: Path) -> None:
    model = Transformer.from_dir(tiny_model_dir)
    ids = torch.randint(0, 96, (1, 40))
    with torch.inference_mode():
        hidden = model(ids, torch.arange(40)[None], model.new_cache(48))[0]  # (40, C)
        random_rows = torch.randn(64, hidden.shape[1]) * 3
        for rows in (hidden, random_rows, hidden[:1]):
            assert model.greedy_tokens(rows) == model.logits(rows).argmax(-1).tolist()


def test_screened_greedy_tokens_resolve_near_ties_exactly(tmp_path: Path) -> None:
    """Two head rows 1e-6 apart: bfloat16 cannot tell them apart, the float32 recheck must."""
    from tests.tiny import make_tiny_hf

    make_tiny_hf("qwen2", tmp_path)  # untied head
    model = Transformer.from_dir(tmp_path)
    head_t = model.head_weight_t()  # (C, V)
    with torch.no_grad():
        head_t[:, 7] = head_t[:, 5] + 1e-6 * torch.randn(head_t.shape[0])
    x = head_t[:, 5].clone().unsqueeze(0) * 50  # both 5 and 7 score highest, almost equally
    expected = model.logits(x).argmax(-1).tolist()
    assert expected[0] in (5, 7)
    assert model.greedy_tokens(x) == expected
