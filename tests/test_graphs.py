"""The fixed-size forward that CUDA graphs replay (`engine.graphs`, `attention.StaticPlan`), run
eagerly here so that any machine checks it: the same rows as the usual forward, nothing written
outside the step's slots, and every method through it still reproducing plain greedy decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.attention import AttentionPlan, Segment, tree_mask
from specdecode.engine.config import EngineConfig
from specdecode.engine.graphs import MIN_COLUMNS, ROW_BUCKETS, GraphRunner
from specdecode.engine.llm_engine import LLMEngine
from specdecode.engine.paged_cache import PagedCache, PagedKVStorage
from specdecode.models.transformer import Transformer
from specdecode.tree import DraftTree
from tests.test_speculative_api import PROMPTS, methods, tiny_paths  # noqa: F401 (a fixture)
from tests.tiny import load_tiny_hf

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Transformer:
    return load_tiny_hf(tmp_path_factory.mktemp("graphs"), "qwen2")


@torch.inference_mode()
def test_static_plan_rows_equal_the_attention_plans(model: Transformer) -> None:
    """Two sequences in one step, a chain after a 7-token prefix and a tree after a 3-token one:
    the buffers' forward gives the usual forward's rows and writes only the step's slots."""
    storage = PagedKVStorage(model.config, num_blocks=16, block_size=4)
    a, b = PagedCache(storage, 64), PagedCache(storage, 64)
    for cache, prompt in ((a, [5, 6, 7, 8, 9, 10, 11]), (b, [20, 21, 22])):
        plan = AttentionPlan([Segment.append(cache, len(prompt))])
        model.forward_plan(torch.tensor([prompt]), torch.arange(len(prompt))[None], plan)
        plan.commit()
    tree = DraftTree(torch.tensor([30, 31, 32]), torch.tensor([0, 0, 1]))  # root, two children, a grandchild
    chain = Segment.append(a, 3)
    branch = Segment.append(b, 4, tree_mask(b.length, tree.ancestor_mask()))
    ids = torch.tensor([12, 13, 14, 23, 30, 31, 32])
    positions = torch.cat([7 + torch.arange(3), 3 + tree.depths()])
    segments = [chain, branch]

    want = model.forward_plan(ids[None], positions[None], AttentionPlan(segments, prefill_from=7))[0]
    before_k = storage.k.clone()
    runner = GraphRunner(model, storage, capture=False)
    got = runner.forward(ids, positions, segments)
    assert got.shape == want.shape == (7, model.config.hidden_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert set(runner.graphs) == {(8, MIN_COLUMNS)}  # 7 rows padded to 8, 14 columns to 256

    step = torch.cat([a.slot_table(10)[7:], b.slot_table(7)[3:]])  # the slots the step wrote
    others = torch.ones(storage.k.shape[2], dtype=torch.bool)
    others[step] = False
    others[storage.scratch] = False  # the padded row's
    bits = storage.k.view(torch.int32)  # bit patterns: slots never written may hold NaNs
    assert torch.equal(bits[:, :, others], before_k.view(torch.int32)[:, :, others])


def test_every_method_through_the_buffers_reproduces_plain_greedy(tiny_paths) -> None:  # noqa: F811
    """The engine's steps through an eager runner (its CUDA path without a GPU): each method's
    greedy output is still plain decoding's, several requests in a step and one alone."""
    llm = LLM(model=str(tiny_paths[0]), device="cpu", progress=False)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    usual = [o.token_ids for o in llm.generate(PROMPTS, params, speculative=None)]
    llm.engine.graphs = runner = GraphRunner(llm.model, llm.engine.storage, capture=False)
    plain = [o.token_ids for o in llm.generate(PROMPTS, params, speculative=None)]
    assert plain == usual
    for spec in methods(tiny_paths[1]):
        assert [o.token_ids for o in llm.generate(PROMPTS, params, speculative=spec)] == plain, spec
        assert llm.generate(PROMPTS[:1], params, speculative=spec)[0].token_ids == plain[0], spec
    assert {rows for rows, _ in runner.graphs} >= {1, 4, 8}  # alone, batched, and drafts verified


def test_capture_makes_every_bucket_up_to_the_columns_asked(model: Transformer) -> None:
    runner = GraphRunner(model, PagedKVStorage(model.config, num_blocks=8, block_size=4), capture=False)
    runner.capture_all(1024)
    assert set(runner.graphs) == {(r, c) for r in ROW_BUCKETS for c in (MIN_COLUMNS, 512, 1024)}


def test_runner_declines_what_no_bucket_holds(model: Transformer, tmp_path: Path) -> None:
    storage = PagedKVStorage(model.config, num_blocks=40, block_size=4)
    runner = GraphRunner(model, storage, capture=False)
    cache = PagedCache(storage, 128)
    assert runner.takes([Segment.append(cache, 64)])
    assert not runner.takes([Segment.append(cache, 65)])  # more rows than the largest bucket
    other = PagedKVStorage(model.config, num_blocks=4, block_size=4)
    assert not runner.takes([Segment.append(PagedCache(other, 16), 1)])  # another storage


def test_the_policys_curve_is_timed_as_the_engine_steps(model: Transformer) -> None:
    """`LLMEngine.forward_seconds` times the widths its graphs hold through them (here run
    eagerly) and the others through the model's forward, and gives its blocks back."""
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=1 << 22, policy=False))
    engine.graphs = GraphRunner(model, engine.storage, capture=False)
    seconds = engine.forward_seconds([1, 4, 128], context=16, repeats=2)
    assert set(seconds) == {1, 4, 128} and all(len(s) == 2 and min(s) > 0 for s in seconds.values())
    assert set(engine.graphs.graphs) == {(1, MIN_COLUMNS), (4, MIN_COLUMNS)}  # 128 rows: no bucket
    assert engine.pool.num_used == 0
