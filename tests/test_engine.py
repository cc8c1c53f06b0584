"""Serving engine core: the block pool and paged cache against the static cache, batch invariance
of 32 concurrent greedy requests with mixed methods, no leaked blocks, admission under a tiny
budget, preemption, prefix reuse, and the load policy's choices."""

from __future__ import annotations

import math
import random

import pytest
import torch

from specdecode import LLM, SamplingParams, SpecDecodeError
from specdecode.attention import AttentionPlan, Segment, causal_mask, tree_mask
from specdecode.drafters.base import Drafter
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.medusa import save_heads
from specdecode.engine.block_pool import BlockPool
from specdecode.engine.config import EngineConfig
from specdecode.engine.llm_engine import EngineRequest, LLMEngine, RequestDelta
from specdecode.engine.paged_cache import PagedCache, PagedKVStorage
from specdecode.engine.policy import METHOD_PRIOR, Candidate, LatencyCurve, SpeculationPolicy, accept_rates
from specdecode.request import Proposal, Request, StepResult
from specdecode.spec_config import parse_speculative
from specdecode.tree import DraftTree
from tests.test_draft_model import tiny_transformer
from tests.test_eagle import run_prefix
from tests.test_medusa import random_heads
from tests.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.usefixtures("one_thread")

FLAT_CURVE = ((1, 0.03), (512, 0.03))  # forward cost independent of width: drafting always pays


# ------------------------------------------------------------------------------------------------
# Block pool


def test_pool_refcounts_and_free_order() -> None:
    pool = BlockPool(4, block_size=2)
    a, b = pool.allocate(), pool.allocate()
    assert (pool.num_used, pool.num_free) == (2, 2)
    pool.register(a, 0, [5, 6])
    pool.free(a)
    pool.free(b)
    # b holds nothing reusable, so it is handed out before the cached a (and before the never-used).
    assert pool.allocate() == b
    assert pool.num_cached == 1
    with pytest.raises(AssertionError):
        pool.free(a)


def test_prefix_match_needs_the_whole_prefix() -> None:
    pool = BlockPool(8, block_size=2)
    blocks = [pool.allocate() for _ in range(3)]
    h = 0
    for block, tokens in zip(blocks, ([1, 2], [3, 4], [5, 6]), strict=True):
        h = pool.register(block, h, tokens)
    assert pool.match_prefix([1, 2, 3, 4, 5, 6, 7])[0] == blocks
    assert pool.match_prefix([1, 2, 3, 4, 5])[0] == blocks[:2]  # a partial block never matches
    assert pool.match_prefix([9, 2, 3, 4, 5, 6])[0] == []  # same later blocks, other prefix
    assert pool.match_prefix([1, 2, 3, 9, 5, 6])[0] == blocks[:1]
    matched, _ = pool.match_prefix([1, 2, 3, 4])
    pool.take(matched)
    assert [pool.refcount[b] for b in blocks] == [2, 2, 1]
    assert pool.num_reused == 2


def test_lru_eviction_of_cached_blocks() -> None:
    pool = BlockPool(3, block_size=1)
    blocks = [pool.allocate() for _ in range(3)]
    for i, block in enumerate(blocks):
        pool.register(block, 0, [10 + i])
    for block in (blocks[1], blocks[0], blocks[2]):  # freed in this order
        pool.free(block)
    assert pool.num_free == 3 and pool.num_cached == 3
    # A cached free block can still be taken back ...
    matched, _ = pool.match_prefix([12])
    assert matched == [blocks[2]]
    pool.take(matched)
    # ... and fresh allocations evict the least recently freed first.
    assert pool.allocate() == blocks[1]
    assert pool.match_prefix([11])[0] == []
    assert pool.match_prefix([10])[0] == [blocks[0]]
    pool.clear_prefix_cache()
    assert pool.match_prefix([10])[0] == [] and pool.match_prefix([12])[0] == [blocks[2]]


# ------------------------------------------------------------------------------------------------
# Paged cache against the static cache


def run_both(model, caches, ids: list[int], mask_among: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The same forward on every cache; returns each one's hidden states (T, C)."""
    out = []
    for cache in caches:
        start = cache.length
        t = len(ids)
        mask = None if mask_among is None else tree_mask(start, mask_among)
        if mask is None and t > 1 and start > 0:
            mask = causal_mask(start, t)
        depths = torch.arange(t) if mask_among is None else mask_among.sum(1) - 1
        plan = AttentionPlan([Segment(cache, cache.reserve(t), t, mask)])
        out.append(model.forward_plan(torch.tensor([ids]), (start + depths)[None], plan)[0])
        plan.commit()
    return out


@torch.inference_mode()
def test_paged_cache_equals_static_cache() -> None:
    model = tiny_transformer(50, seed=0, layers=2)
    storage = PagedKVStorage(model.config, num_blocks=32, block_size=4)
    static, paged = model.new_cache(128), PagedCache(storage, 128)
    caches = [static, paged]
    a, b = run_both(model, caches, list(range(3, 14)))  # prefill across block boundaries
    torch.testing.assert_close(a, b)
    tree = DraftTree(torch.tensor([7, 8, 9, 10, 11]), torch.tensor([0, 1, 0, 3, 4]))
    start = static.length
    a, b = run_both(model, caches, [20, *tree.tokens.tolist()], tree.ancestor_mask())
    torch.testing.assert_close(a, b)
    for cache in caches:
        cache.compact(start, [0, 3, 4, 5])  # root + the path 3 -> 4 -> 5
    assert paged.length == static.length == start + 4
    assert len(paged.blocks) == -(-paged.length // 4)  # the tree's extra blocks were freed
    a, b = run_both(model, caches, [30, 31])
    torch.testing.assert_close(a, b)
    for cache in caches:
        cache.rollback(5)
    a, b = run_both(model, caches, [40, 41, 42])
    torch.testing.assert_close(a, b)
    paged.release()
    assert storage.pool.num_used == 0


@torch.inference_mode()
def test_shared_block_is_copied_before_a_write() -> None:
    model = tiny_transformer(50, seed=0)
    storage = PagedKVStorage(model.config, num_blocks=8, block_size=4)
    first = PagedCache(storage, 64)
    run_both(model, [first], list(range(3, 9)))  # 6 tokens: one full block + 2
    first.register_full_blocks(list(range(3, 9)))
    before = storage.k.clone()
    second = PagedCache(storage, 64)
    blocks, h = storage.pool.match_prefix(list(range(3, 9)))
    storage.pool.take(blocks)
    second.adopt(blocks, h)
    assert second.blocks == first.blocks[:1] and second.length == 4
    second.truncate(4)
    # Rolling back into a registered block is refused; writing after it takes a fresh block.
    with pytest.raises(ValueError, match="registered"):
        second.truncate(2)
    run_both(model, [second], [40, 41])
    shared = first.blocks[0] * 4
    torch.testing.assert_close(storage.k[:, :, shared : shared + 4], before[:, :, shared : shared + 4])


# ------------------------------------------------------------------------------------------------
# The engine on a tiny model, through the LLM API


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[LLM, list[dict | None]]:
    import os

    root = tmp_path_factory.mktemp("serving")
    os.environ["SPECDECODE_CACHE"] = str(root / "cache")
    target = write_tiny_gguf(root / "target.gguf", "llama", seed=0).path
    draft = write_tiny_gguf(root / "draft.gguf", "llama", seed=1).path
    llm = LLM(model=str(target), device="cpu", progress=False)
    heads = save_heads(random_heads(llm.model), root / "heads", target="tiny")
    methods = [
        None,
        {"method": "prompt_lookup"},
        {"method": "prompt_lookup", "num_candidates": 3, "max_matching_ngram_size": 3},
        {"method": "lookahead", "window_size": 3, "ngram_size": 3, "verification_set_size": 3},
        {"method": "draft_model", "draft_model": str(draft), "num_draft_tokens": 3},
        {"method": "medusa", "heads": str(heads)},
    ]
    return llm, methods


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        base = [rng.randrange(3, 90) for _ in range(rng.randrange(2, 12))]
        out.append((base * 4)[: rng.randrange(2, 45)])  # repetitive: prompt lookup finds matches
    return out


def serve(
    engine: LLMEngine,
    requests: list[EngineRequest],
    per_step: int = 3,
    abort_after: dict[str, int] | None = None,
) -> dict[str, list[int]]:
    """Add `per_step` requests before each step (staggered arrivals) until all finish; abort the
    ids in `abort_after` once they have that many tokens."""
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    queue = list(requests)
    abort_after = dict(abort_after or {})
    while queue or engine.has_unfinished():
        for _ in range(per_step):
            if queue:
                engine.add_request(queue.pop(0))
        deltas: list[RequestDelta] = engine.step()
        for d in deltas:
            out[d.request_id] += d.new_token_ids
            assert d.finished == (d.finish_reason is not None)
        for rid, n in list(abort_after.items()):
            if len(out[rid]) >= n:
                engine.abort(rid)
                del abort_after[rid]
    return out


def alone(llm: LLM, prompt: list[int], params: SamplingParams, spec: dict | None) -> list[int]:
    return llm.generate([prompt], params, speculative=spec)[0].token_ids


def test_engine_counts_decoding_steps_by_rows(setup) -> None:
    """`EngineStats.decode_steps`: every step without prompt rows, by the rows of its forward
    (root and drafts), with its seconds and its forward's, except the step that timed the
    policy's latency curve (its first budget): a request's prefill step and that one are left out."""
    llm, _ = setup
    engine = llm.new_engine(EngineConfig(block_size=4, policy=True))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    engine.add_request(
        EngineRequest("a", prompts(1)[0] * 3, params, parse_speculative({"method": "prompt_lookup"}))
    )
    steps, tokens = 0, 0
    while engine.has_unfinished():
        tokens += sum(len(d.new_token_ids) for d in engine.step())
        steps += 1
    counted = engine.stats.decode_steps
    assert tokens == 16 and engine.policy is not None and engine.policy.measured
    assert sum(int(n) for n, _, _ in counted.values()) == steps - 2  # less the prefill and the timing
    # each with its seconds, and of them its target forward's: some, not all (the LM head and
    # verifying come after it)
    assert all(rows >= 1 and 0 < forward < seconds for rows, (_, seconds, forward) in counted.items())
    assert any(rows > 1 for rows in counted)  # repetitive: prompt lookup verified drafts


@pytest.mark.parametrize("policy", [False, True])
def test_batch_invariance_and_no_leak(setup, policy: bool) -> None:
    llm, methods = setup
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    ps = prompts(32)
    specs = [methods[i % len(methods)] for i in range(32)]
    expected = {str(i): alone(llm, p, params, s) for i, (p, s) in enumerate(zip(ps, specs, strict=True))}
    config = EngineConfig(
        block_size=4, max_num_seqs=16, max_batch_tokens=64, policy=policy, latency_curve=FLAT_CURVE
    )
    engine = llm.new_engine(config)
    requests = [
        EngineRequest(str(i), p, params, parse_speculative(s))
        for i, (p, s) in enumerate(zip(ps, specs, strict=True))
    ]
    aborted = {"3": 4, "10": 1, "17": 9}
    out = serve(engine, requests, abort_after=aborted)
    for rid, tokens in out.items():
        if rid in aborted:
            assert tokens == expected[rid][: len(tokens)]
        else:
            assert tokens == expected[rid], rid
    stats = engine.stats
    assert stats.num_finished == 32 - 3 and stats.num_aborted == 3
    assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0
    engine.clear_prefix_cache()
    assert engine.pool.num_cached == 0 and engine.pool.num_free == engine.pool.num_blocks
    assert set(stats.drafts_proposed) == {"prompt_lookup", "lookahead", "draft_model", "medusa"}
    for method, accepted in stats.accepted_by_position.items():
        assert all(a <= p for a, p in zip(accepted, stats.proposed_by_position[method], strict=True))


def test_tiny_budget_waits_and_preempts(setup) -> None:
    llm, methods = setup
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ps = prompts(8, seed=1)
    specs = [methods[i % 2] for i in range(8)]
    expected = {str(i): alone(llm, p, params, s) for i, (p, s) in enumerate(zip(ps, specs, strict=True))}
    per_block = PagedKVStorage.block_bytes(llm.model.config, 4, llm.model.dtype)
    # 24 blocks of 4 tokens: one request needs up to 19; two cannot both grow to their end.
    config = EngineConfig(block_size=4, kv_cache_memory=24 * per_block, policy=False, prefix_caching=False)
    engine = llm.new_engine(config)
    requests = [
        EngineRequest(str(i), p, params, parse_speculative(s))
        for i, (p, s) in enumerate(zip(ps, specs, strict=True))
    ]
    waited = False
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished():
        for d in engine.step():
            out[d.request_id] += d.new_token_ids
        waited |= engine.stats.num_waiting > 0 and engine.stats.num_running > 0
    assert out == expected
    assert waited and engine.stats.num_preemptions > 0
    assert engine.stats.kv_blocks_used == 0


def test_prefix_reuse_skips_compute(setup) -> None:
    llm, _ = setup
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    shared = list(range(3, 53))  # 50 tokens: 6 full blocks of 8
    first, second = [*shared, 5, 6, 7], [*shared, 8, 9]
    engine = llm.new_engine(EngineConfig(block_size=8, policy=False))
    rows: list[int] = []
    forward = engine.model.forward_plan

    def counting(ids, positions, plan):
        rows.append(ids.shape[1])
        return forward(ids, positions, plan)

    engine.model.forward_plan = counting  # type: ignore[method-assign]
    try:
        out = serve(engine, [EngineRequest("a", first, params, None)])
        assert sum(rows) == len(first) - 1 + 6  # its prompt but the root, then 6 one-row steps
        rows.clear()
        deltas: list[RequestDelta] = []
        engine.add_request(EngineRequest("b", second, params, None))
        while engine.has_unfinished():
            deltas += engine.step()
    finally:
        del engine.model.forward_plan
    assert out["a"] == alone(llm, first, params, None)
    assert [t for d in deltas for t in d.new_token_ids] == alone(llm, second, params, None)
    assert deltas[-1].num_cached_prompt_tokens == 48  # 6 full blocks of the 50 shared tokens
    assert engine.stats.kv_blocks_reused == 6
    assert sum(rows) == len(second) - 1 - 48 + 6  # the reused blocks were not recomputed


def test_a_draft_model_reuses_its_blocks_of_an_earlier_prompt(setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt that starts like an earlier request's (a conversation's next turn): the draft model
    prefills only what its own prefix cache lacks, as the target does; the text is unchanged.
    Without prefix caching it prefills the whole prompt."""
    llm, methods = setup
    spec = parse_speculative(methods[4])
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    shared = list(range(3, 53))  # 50 tokens: 6 full blocks of 8
    first, second = [*shared, 5, 6, 7], [*shared, 8, 9]
    want_out = {"a": alone(llm, first, params, methods[4]), "b": alone(llm, second, params, methods[4])}
    prefilled: list[int] = []
    feed = DraftModelDrafter._feed

    def recording(self: DraftModelDrafter, tokens: list[int], prompt: bool = False) -> torch.Tensor:
        if prompt:
            prefilled.append(len(tokens))
        return feed(self, tokens, prompt)

    monkeypatch.setattr(DraftModelDrafter, "_feed", recording)
    for caching, want in (
        (True, [len(first) - 1, len(second) - 1 - 48]),
        (False, [len(first) - 1, len(second) - 1]),
    ):
        prefilled.clear()
        engine = llm.new_engine(EngineConfig(block_size=8, policy=False, prefix_caching=caching))
        out = serve(engine, [EngineRequest("a", first, params, spec)])
        out |= serve(engine, [EngineRequest("b", second, params, spec)])
        assert out == want_out
        assert prefilled == want  # each prompt but its root, less the draft's reused blocks
        (storage,) = engine.draft_storages.values()
        assert storage.pool.num_reused == (6 if caching else 0)


class RecordingDrafter(Drafter):
    """Drafts nothing; keeps the prompt rows the engine hands to `begin`."""

    def __init__(self) -> None:
        self.prompt_hidden: torch.Tensor | None = None

    def begin(self, req: Request, prompt_hidden: torch.Tensor) -> None:
        self.prompt_hidden = prompt_hidden.clone()

    def propose(self, req: Request, budget: int | None = None) -> Proposal:
        return Proposal(DraftTree.empty())


def test_drafters_get_every_prompt_row_however_the_prompt_was_cached(setup) -> None:
    """`Drafter.begin`'s contract: the rows of positions 0 .. P-2, whether the prompt was prefilled
    in chunks, wholly served from reused blocks (all but the root) or partly (a shared prefix)."""
    llm, _ = setup
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    first = [(7 * i) % 80 + 3 for i in range(21)]  # 20 rows before the root: 5 full blocks
    partial = [*first[:13], 9, 8, 7]  # 12 rows (3 blocks) shared
    engine = llm.new_engine(EngineConfig(block_size=4, max_batch_tokens=8, policy=False))

    def begun(prompt: list[int]) -> tuple[torch.Tensor, int]:
        drafter = RecordingDrafter()
        seq = engine.add_request(EngineRequest(str(len(engine.sequences)), prompt, params, None), drafter)
        while engine.has_unfinished():
            engine.step()
        assert drafter.prompt_hidden is not None
        return drafter.prompt_hidden, seq.num_cached_prompt_tokens

    chunked, cached = begun(first)  # 20 rows in chunks of 8
    assert cached == 0
    torch.testing.assert_close(chunked, run_prefix(llm.model, first), rtol=1e-4, atol=1e-4)
    whole_hit, cached = begun(first)
    assert cached == 20 and torch.equal(whole_hit, chunked)  # nothing computed but the root
    part_hit, cached = begun(partial)
    assert cached == 12 and part_hit.shape == (len(partial) - 1, chunked.shape[1])
    assert torch.equal(part_hit[:12], chunked[:12])
    torch.testing.assert_close(part_hit, run_prefix(llm.model, partial), rtol=1e-4, atol=1e-4)


class EveryOtherStep(Drafter):
    """Drafts one guessed token every other step (a plain step between) and records what each
    `observe` says: the request's length then, the tokens and how many target rows came."""

    def __init__(self) -> None:
        self.calls = 0
        self.heard: list[tuple[int, list[int], int]] = []

    def propose(self, req: Request, budget: int | None = None) -> Proposal:
        self.calls += 1
        return Proposal(DraftTree.chain([req.root]) if self.calls % 2 else DraftTree.empty())

    def observe(self, req: Request, result: StepResult) -> None:
        self.heard.append((len(req.all_ids), result.verdict.tokens, result.hidden.shape[0]))


def test_a_drafter_hears_of_every_step_plain_ones_included(setup) -> None:
    """A drafter reading the target's features (EAGLE's head cache, Medusa's last row) needs
    every decided token's row: a plain step (no budget from the policy, or nothing proposed)
    reports its one token and the root's row, so the drafter never falls behind."""
    llm, _ = setup
    params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    prompt = prompts(1, seed=5)[0]
    engine = llm.new_engine(EngineConfig(block_size=4, policy=False))
    drafter = EveryOtherStep()
    engine.add_request(EngineRequest("a", prompt, params, None), drafter)
    out: list[int] = []
    while engine.has_unfinished():
        out += [t for d in engine.step() for t in d.new_token_ids]
    heard = [t for _, tokens, _ in drafter.heard for t in tokens]
    assert out[: len(heard)] == heard and len(out) - len(heard) <= 2  # all but the last step's
    length = len(prompt)
    for n, tokens, _ in drafter.heard:  # every step heard, in order, once its tokens were appended
        length += len(tokens)
        assert n == length
    plain = [tokens for _, tokens, rows in drafter.heard if rows == 1]
    assert len(plain) >= 3 and all(len(tokens) == 1 for tokens in plain)


def test_sampled_requests_keep_their_own_stream(setup) -> None:
    llm, methods = setup
    ps = prompts(6, seed=3)
    params = [SamplingParams(max_tokens=12, temperature=0.8, seed=i) for i in range(6)]
    expected = {str(i): alone(llm, p, params[i], methods[i % 2]) for i, p in enumerate(ps)}
    engine = llm.new_engine(EngineConfig(block_size=4, policy=False))
    requests = [
        EngineRequest(str(i), p, params[i], parse_speculative(methods[i % 2])) for i, p in enumerate(ps)
    ]
    assert serve(engine, requests) == expected


def test_logprobs_in_a_mixed_batch_equal_the_single_request_engines(setup) -> None:
    """Each delta carries one `TokenLogprobs` per new token, as `LLM.generate` computes them
    alone, for every method and for sampled requests too (raw logprobs, not the tempered ones)."""
    llm, methods = setup
    ps = prompts(len(methods) + 2, seed=4)
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2) for _ in methods]
    params += [
        SamplingParams(max_tokens=10, temperature=0.7, seed=i, ignore_eos=True, logprobs=0) for i in (1, 2)
    ]
    specs = [*methods, None, methods[1]]
    engine = llm.new_engine(EngineConfig(block_size=4, policy=False))
    got: dict[str, list] = {str(i): [] for i in range(len(ps))}
    for i, (p, sp, spec) in enumerate(zip(ps, params, specs, strict=True)):
        engine.add_request(EngineRequest(str(i), p, sp, parse_speculative(spec)))
    while engine.has_unfinished():
        for d in engine.step():
            assert d.logprobs is not None and len(d.logprobs) == len(d.new_token_ids)
            got[d.request_id] += d.logprobs
    for i, (p, sp, spec) in enumerate(zip(ps, params, specs, strict=True)):
        want = llm.generate([p], sp, speculative=spec)[0].logprobs
        assert want is not None and len(got[str(i)]) == len(want) == 10
        assert [g.logprob for g in got[str(i)]] == pytest.approx([w.logprob for w in want], abs=1e-4)
        assert [[t for t, _ in g.top] for g in got[str(i)]] == [[t for t, _ in w.top] for w in want]
        assert all(len(g.top) == sp.logprobs for g in got[str(i)])
    assert llm.generate([ps[0]], SamplingParams(max_tokens=2))[0].logprobs is None  # not asked


def draft_specs(llm: LLM, methods: list[dict | None]) -> list[dict]:
    """Draft-model methods: the target as its own draft, another draft, prompt lookup's fallback."""
    return [
        {"method": "draft_model", "draft_model": llm.model_name, "num_draft_tokens": 3},
        methods[4],
        {"method": "prompt_lookup", "draft_model": llm.model_name, "num_candidates": 2},
    ]


def test_draft_models_use_paged_blocks_freed_on_finish_abort_and_preemption(setup) -> None:
    llm, methods = setup
    specs = draft_specs(llm, methods) * 3 + [None]
    ps = prompts(len(specs), seed=5)
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True) for _ in specs]
    params[4] = SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True)
    expected = {str(i): alone(llm, p, params[i], s) for i, (p, s) in enumerate(zip(ps, specs, strict=True))}
    per_block = PagedKVStorage.block_bytes(llm.model.config, 4, llm.model.dtype)
    config = EngineConfig(block_size=4, kv_cache_memory=40 * per_block, policy=False, prefix_caching=False)
    engine = llm.new_engine(config)
    for i, (p, s) in enumerate(zip(ps, specs, strict=True)):
        engine.add_request(EngineRequest(str(i), p, params[i], parse_speculative(s)))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(specs))}
    most_draft_blocks = 0
    while engine.has_unfinished():
        for d in engine.step():
            out[d.request_id] += d.new_token_ids
        most_draft_blocks = max(most_draft_blocks, engine.stats.draft_kv_blocks_used)
        if len(out["7"]) >= 3 and "7" in engine.sequences:
            engine.abort("7")
    cut = out.pop("7")
    assert len(cut) >= 3 and cut == expected.pop("7")[: len(cut)]
    assert out == expected
    assert engine.stats.num_preemptions > 0 and engine.stats.num_aborted == 1
    assert len(engine.draft_storages) == 2  # the target as its own draft, and the other draft model
    assert all(d.pool.num_blocks == engine.pool.num_blocks for d in engine.draft_storages.values())
    assert most_draft_blocks > 0
    assert engine.stats.draft_kv_blocks_used == 0 and engine.stats.kv_blocks_used == 0


def test_short_of_draft_blocks_a_request_decodes_plainly(setup) -> None:
    """A draft pool too small for the request: the steps it cannot draft are plain, still exact."""
    llm, methods = setup
    spec = draft_specs(llm, methods)[0]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # with 16 tokens and 3 drafts: more than 20
    engine = llm.new_engine(EngineConfig(block_size=4, policy=False))
    draft = llm.drafters.draft_model(llm.model_name)
    engine.draft_storages[draft] = PagedKVStorage(draft.config, 5, 4, draft.dtype)  # 20 tokens
    out = serve(engine, [EngineRequest("a", prompt, params, parse_speculative(spec))])
    assert out["a"] == alone(llm, prompt, params, spec)
    assert engine.stats.drafts_proposed["draft_model"] > 0  # it drafted until the blocks ran out
    assert engine.stats.draft_kv_blocks_used == 0


def test_default_draft_model_shares_the_memory_budget(setup) -> None:
    llm, _ = setup
    spec = parse_speculative({"method": "draft_model", "draft_model": llm.model_name})
    draft = llm.drafters.draft_model(llm.model_name)
    target_block = PagedKVStorage.block_bytes(llm.model.config, 4, llm.model.dtype)
    draft_block = PagedKVStorage.block_bytes(draft.config, 4, draft.dtype, hidden=False)
    memory = 50 * target_block
    engine = llm.new_engine(
        EngineConfig(block_size=4, kv_cache_memory=memory, speculative=spec, policy=False)
    )
    assert engine.pool.num_blocks == memory // (target_block + draft_block) < 50
    serve(engine, [EngineRequest("a", prompts(1)[0], SamplingParams(max_tokens=4), spec)])
    assert engine.stats.draft_kv_blocks_total == engine.pool.num_blocks


def test_bad_requests_and_settings(setup) -> None:
    llm, _ = setup
    per_block = PagedKVStorage.block_bytes(llm.model.config, 4, llm.model.dtype)
    engine = llm.new_engine(EngineConfig(block_size=4, kv_cache_memory=8 * per_block, policy=False))
    params = SamplingParams(max_tokens=4)
    with pytest.raises(SpecDecodeError, match="empty"):
        engine.add_request(EngineRequest("x", [], params, None))
    context = llm.model.config.max_position_embeddings
    with pytest.raises(SpecDecodeError, match="context"):
        engine.add_request(EngineRequest("x", [5] * context, params, None))
    with pytest.raises(SpecDecodeError, match="KV blocks"):
        engine.add_request(EngineRequest("x", [5] * 30, SamplingParams(max_tokens=4), None))  # 9 blocks
    engine.add_request(EngineRequest("x", [5, 6], params, None))
    with pytest.raises(SpecDecodeError, match="already in use"):
        engine.add_request(EngineRequest("x", [5, 6], params, None))
    engine.abort("x")
    engine.abort("unknown")
    assert not engine.has_unfinished() and engine.stats.kv_blocks_used == 0
    for kwargs, words in [
        ({"block_size": 0}, "block_size"),
        ({"max_num_seqs": -1}, "max_num_seqs"),
        ({"kv_cache_fraction": 1.5}, "kv_cache_fraction"),
        ({"policy": "yes"}, "policy"),
        ({"speculative": {"method": "nope"}}, "unknown speculative method"),
        ({"latency_curve": ((0, 1.0),)}, "latency_curve"),
    ]:
        with pytest.raises(SpecDecodeError, match=words):
            EngineConfig(**kwargs)
    with pytest.raises(SpecDecodeError, match="kv_cache_memory"):
        llm.new_engine(EngineConfig(kv_cache_memory=10, policy=False))


# ------------------------------------------------------------------------------------------------
# Policy


def test_latency_curve_interpolates() -> None:
    curve = LatencyCurve(((1, 0.03), (4, 0.05), (16, 0.07)))
    assert curve(1) == 0.03 and curve(4) == 0.05
    assert curve(10) == pytest.approx(0.06)
    assert curve(28) == pytest.approx(0.09)  # past the last point: the last slope


def test_policy_speculates_alone_and_backs_off_under_load() -> None:
    # The CPU curve of SmolLM2 (the note's figures): 1 -> 31 ms, 4 -> 49 ms, 64 -> 114 ms; past 64
    # rows a made-up tail, cheap up to 128 then steep.
    points = (
        (1, 0.031),
        (2, 0.043),
        (4, 0.049),
        (8, 0.060),
        (16, 0.071),
        (64, 0.114),
        (128, 0.14),
        (512, 0.9),
    )
    curve = LatencyCurve(points)
    policy = SpeculationPolicy(curve)
    good = Candidate(4, [0.7, 0.5, 0.35, 0.25], 0.0)
    poor = Candidate(4, [0.2, 0.08, 0.03, 0.01], 0.0)
    assert policy.budgets([good], 1, 512) == [4]
    assert policy.budgets([poor], 1, 512) == [0]
    wide = policy.budgets([poor] * 64, 64, 512)
    assert wide == [0] * 64
    # Under load the good requests keep some draft, the poor ones none.
    mixed = policy.budgets([good] * 8 + [poor] * 56, 64, 512)
    assert sum(mixed[8:]) == 0 and all(k >= 1 for k in mixed[:8])
    # A costly drafter (a draft model's forwards) gets less than a free one.
    costly = Candidate(4, good.accept_rates, 0.02)
    assert policy.budgets([costly], 1, 512)[0] < 4


def test_accept_rates_are_optimistic_products_of_conditional_rates() -> None:
    # The request: depth 1 accepted 9 times in 10, depth 2 once in the 9 steps that reached it.
    # Its method: 20 steps at each depth, half accepted.
    rates = accept_rates([10, 9, 1], [9, 1, 1], [20, 20, 20], [10, 10, 10], 4)
    prior = (10 + METHOD_PRIOR * 0.8) / (20 + METHOD_PRIOR)  # the method's rate, from the 0.8 prior
    first = (9 + 4 * prior) / 14  # own counts shrunk towards it
    assert rates[0] == pytest.approx(first + math.sqrt(first * (1 - first) / 34))  # 10 + 4 + 20
    assert rates[0] >= rates[1] >= rates[2] >= rates[3]
    # Many counts: the bound closes on the mean.
    assert accept_rates([10_000], [5_000], [10_000], [5_000], 1)[0] == pytest.approx(0.5, abs=0.006)
    # A depth the method never reached continues the conditional rate of the one before it.
    deep = accept_rates([1000, 1000], [900, 810], [1000, 1000], [900, 810], 4)
    assert deep[3] / deep[2] == pytest.approx(deep[2] / deep[1], rel=0.02)
    assert deep[3] > 0.6  # not 0.8^4 = 0.41
    # Weight: a request's counts fade while the policy keeps it plain, back to its method's rate.
    faded = accept_rates([20], [2], [100], [50], 1, weight=0.001)[0]
    assert faded > accept_rates([20], [2], [100], [50], 1)[0]
    assert faded == pytest.approx(accept_rates([], [], [100], [50], 1)[0], abs=0.02)


def test_one_unlucky_draft_does_not_stop_a_method_for_good() -> None:
    policy = SpeculationPolicy(LatencyCurve(((1, 0.030), (2, 0.034), (4, 0.042), (8, 0.070))))
    # The method's one step so far failed at depth 1: it drafts again.
    unlucky = Candidate(4, accept_rates([1], [0], [1], [0], 4), 0.006)
    assert policy.budgets([unlucky], 1, 512)[0] > 0
    # Forty steps with 4 accepted: it does not.
    hopeless = Candidate(4, accept_rates([], [], [40], [4], 4), 0.006)
    assert policy.budgets([hopeless], 1, 512)[0] == 0
    # With no counts at all the optimistic prior makes a lone request draft, so counts appear.
    assert policy.budgets([Candidate(4, accept_rates([], [], [], [], 4), 0.0)], 1, 512)[0] > 0


@pytest.mark.parametrize("probe", [True, False])
def test_one_slow_proposal_does_not_keep_a_request_plain(setup, monkeypatch, probe: bool) -> None:
    """A pause inside one `propose` (its drafting cost read as 0.3 s a token) makes drafting look
    ruinous; a request kept plain then drafts one token every PROBE_STEPS steps, its method's cost
    is the lower median of its proposals, and drafting resumes. Without the probes (the control)
    nothing ever measures the cost again and the request stays plain to its end."""
    import time

    from specdecode.engine import llm_engine

    if not probe:
        monkeypatch.setattr(llm_engine, "PROBE_STEPS", 10**9)
    llm, _ = setup
    prompt = [5, 9, 13, 17, 21] * 8
    params = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)
    engine = llm.new_engine(EngineConfig(latency_curve=FLAT_CURVE))
    drafter = engine.drafters.build(parse_speculative({"method": "prompt_lookup"}))
    assert drafter is not None
    calls: list[int] = []
    propose = drafter.propose

    def stalling(req: Request, budget: int | None = None) -> Proposal:
        calls.append(len(req.output_ids))
        if len(calls) == 2:  # the first proposal measured (a request's first is not)
            time.sleep(0.3)
        return propose(req, budget)

    drafter.propose = stalling  # type: ignore[method-assign]
    seq = engine.add_request(EngineRequest("a", prompt, params, None), drafter)
    while engine.has_unfinished():
        engine.step()
    assert seq.req.output_ids == alone(llm, prompt, params, None)
    after = [n for n in calls if n > calls[1]]
    if probe:
        assert len(after) >= 20  # probes, then drafting most steps again
    else:
        assert after == []


class TwoWays(Drafter):
    """Drafts the next tokens of a known answer (always accepted) in two ways that take turns
    step by step: "cheap" at once, "dear" after 40 ms a token (more than a verified token saves
    under FLAT_CURVE's 30 ms forward)."""

    max_nodes = 3

    def __init__(self, answer: list[int], prompt_len: int) -> None:
        self.answer, self.prompt_len = answer, prompt_len
        self.way = "dear"
        self.proposed: dict[str, int] = {"cheap": 0, "dear": 0}

    def source(self, req: Request) -> str:
        self.way = "cheap" if self.way == "dear" else "dear"
        return self.way

    def propose(self, req: Request, budget: int | None = None) -> Proposal:
        import time

        k = min(budget or self.max_nodes, self.max_nodes)
        self.proposed[self.way] += 1
        if self.way == "dear":
            time.sleep(0.04 * k)
        done = len(req.all_ids) - self.prompt_len
        return Proposal(DraftTree.chain(self.answer[done : done + k]))


def test_the_policy_costs_each_way_of_drafting_apart(setup) -> None:
    """A drafter with two ways of drafting (a lookup branch's copy from the text and its head's
    chain) has a cost for each (`Drafter.source`), so the policy drafts the cheap way's steps
    and keeps the dear way's plain once it is measured. One running cost for both averages them
    and treats both ways alike (here both plain: the average costs more than a token saves)."""
    llm, _ = setup
    prompt = [5, 9, 13, 17, 21] * 4
    params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    answer = alone(llm, prompt, params, None)
    engine = llm.new_engine(EngineConfig(latency_curve=FLAT_CURVE))
    drafter = TwoWays(answer, len(prompt))
    seq = engine.add_request(EngineRequest("a", prompt, params, None), drafter)
    while engine.has_unfinished():
        engine.step()
    assert seq.req.output_ids == answer
    assert drafter.proposed["dear"] <= 3 < 10 <= drafter.proposed["cheap"]
    assert seq.draft_costs["dear"] >= 0.03 > 0.005 >= seq.draft_costs["cheap"]
    costs = engine.stats.draft_cost
    assert costs["TwoWays", "dear"] >= 0.03 > 0.005 >= costs["TwoWays", "cheap"]


def test_prompt_lookup_counts_acceptance_by_match_length(setup) -> None:
    """Prompt lookup's drafting steps are counted under the way its continuation was found
    (`PromptLookupDrafter.source`: "lookup:1" .. "lookup:4" by how much of the text's end the
    occurrence shares), engine-wide and per request, so the policy weighs a weak match's draft
    apart from a strong one's; the copy's drafting cost is one ("lookup"). Output is plain
    decoding's."""
    llm, _ = setup
    prompt = [5, 9, 13, 17, 21, 3, 9, 13, 40, 41] * 3
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    spec = parse_speculative({"method": "prompt_lookup"})
    engine = llm.new_engine(EngineConfig(latency_curve=FLAT_CURVE))
    seq = engine.add_request(EngineRequest("a", prompt, params, spec))
    while engine.has_unfinished():
        engine.step()
    assert seq.req.output_ids == alone(llm, prompt, params, None)
    ways = {source: s for (method, source), s in engine.stats.ways.items() if method == "prompt_lookup"}
    # no counts under "lookup:0": a look-up that found nothing drafted nothing
    assert ways and set(ways) <= {"lookup:1", "lookup:2", "lookup:3", "lookup:4"}, ways
    assert set(seq.ways) == set(ways)
    drafted = sum(s.proposed_by_position[0] for s in ways.values() if s.proposed_by_position)
    assert drafted == engine.stats.proposed_by_position["prompt_lookup"][0] > 0
    assert set(seq.draft_costs) == {"lookup"} and ("prompt_lookup", "lookup") in engine.stats.draft_cost
    # A copy after a match of g < 4 tokens drafts at most g (`copy_limit`), though the flat curve
    # makes every row look free; a match of four or more drafts deeper.
    # (proposed_by_position[d]: steps that drafted a (d+1)-th token)
    for source, counts in ways.items():
        grade = int(source.partition(":")[2])
        if grade < 4:
            assert not any(counts.proposed_by_position[grade:]), (source, counts.proposed_by_position)
    assert any(ways["lookup:4"].proposed_by_position[3:]), ways["lookup:4"].proposed_by_position
    assert any(grade in ways for grade in ("lookup:1", "lookup:2", "lookup:3")), ways


@pytest.mark.real
def test_smollm2_batch_equals_solo() -> None:
    llm = LLM(model="smollm2-135m", progress=False)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    texts = ["The capital of France is", "def add(a, b):", "1, 2, 3, 4, 5,", "Once upon a time"]
    specs: list[dict | None] = [None, {"method": "prompt_lookup"}] * 2
    ps = [llm.tokenizer.encode(t, add_special_tokens=True) for t in texts]
    expected = {str(i): alone(llm, p, params, s) for i, (p, s) in enumerate(zip(ps, specs, strict=True))}
    engine = llm.new_engine(EngineConfig(kv_cache_memory=64 * 2**20, latency_curve=FLAT_CURVE))
    requests = [
        EngineRequest(str(i), p, params, parse_speculative(s))
        for i, (p, s) in enumerate(zip(ps, specs, strict=True))
    ]
    assert serve(engine, requests, per_step=2) == expected
    assert engine.stats.kv_blocks_used == 0


def test_latency_curve_measures_a_model_whose_context_is_shorter_than_the_batch(tiny_model_dir) -> None:
    """`max_batch_tokens` beyond the model's context (the tiny models hold 256 positions)
    measures what fits instead of failing, and extends the curve past it."""
    from specdecode.models.transformer import Transformer

    model = Transformer.from_dir(tiny_model_dir)
    curve = LatencyCurve.measure(model, max_tokens=512)
    assert curve.tokens[-1] <= model.config.max_position_embeddings // 2
    assert curve(512) >= curve(curve.tokens[-1]) > 0


# ------------------------------------------------------------------------------------------------
# The offline facade on the engine


def test_llm_generate_batches_mixed_methods_like_each_prompt_alone(setup) -> None:
    """`LLM.generate` over 32 prompts at once, a speculative method per prompt, gives every greedy
    prompt exactly the tokens it gets alone, in input order; sampled prompts keep their seeds."""
    llm, methods = setup
    ps = prompts(32, seed=7)
    specs = [methods[i % len(methods)] for i in range(32)]
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True) for _ in range(30)]
    params += [SamplingParams(max_tokens=16, temperature=0.8, seed=s, ignore_eos=True) for s in (3, 4)]
    expected = [alone(llm, p, sp, s) for p, sp, s in zip(ps, params, specs, strict=True)]
    outs = llm.generate(ps, params, speculative=specs)
    assert [o.token_ids for o in outs] == expected
    assert [o.prompt_token_ids for o in outs] == ps
    assert llm.engine.stats.num_running == 0 and llm.engine.stats.kv_blocks_used == 0
    # Every output has its own timing from the engine.
    assert all(o.timing.first_token_s > 0 and o.timing.total_s >= o.timing.first_token_s for o in outs)


def test_llm_generate_arguments(setup) -> None:
    llm, methods = setup
    ps = prompts(3, seed=8)
    with pytest.raises(SpecDecodeError, match="params has 2 entries for 3 prompts"):
        llm.generate(ps, [SamplingParams(max_tokens=2)] * 2)
    with pytest.raises(SpecDecodeError, match="speculative has 1 entries for 3 prompts"):
        llm.generate(ps, SamplingParams(max_tokens=2), speculative=[None])
    with pytest.raises(SpecDecodeError):  # a bad prompt among good ones: none of them runs
        llm.generate([ps[0], [10**9]], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()
    # A stream left half-read gives its blocks back.
    stream = llm.stream(ps[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished() and llm.engine.stats.kv_blocks_used == 0
    # Two streams read in turn each get their own text.
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    a, b = llm.stream(ps[1], params), llm.stream(ps[2], params, speculative=methods[1])
    texts, live = ["", ""], [a, b]
    while live:
        for i, stream in enumerate([a, b]):
            if stream in live:
                piece = next(stream, None)
                if piece is None:
                    live.remove(stream)
                else:
                    texts[i] += piece
    assert texts == [o.text for o in llm.generate([ps[1], ps[2]], params, speculative=[None, methods[1]])]


@pytest.mark.real
@pytest.mark.parametrize("method", ["eagle2", "redrafter"])
def test_trained_drafters_in_the_engine_match_their_solo_run(method: str) -> None:
    """EAGLE-2 and ReDrafter learn from the prompt's features. Served with a prompt longer than
    the forward's rows (prefilled in chunks) and with a prompt whose prefix comes from reused KV
    blocks, each reaches the tokens it reaches alone, at a τ within 5% of its solo run."""
    spec = {"method": method, "prompt_lookup_num_tokens": 0}  # the heads alone
    llm = LLM(model="smollm2-135m", progress=False, speculation_policy=False)  # whole drafts both ways
    article = " ".join(f"Fact {i}: the {w} river flows north." for i, w in enumerate(["red", "blue"] * 30))
    long_prompt = llm.chat_prompt([{"role": "user", "content": f"{article}\n\nSummarize the facts."}])
    shared = llm.chat_prompt([{"role": "user", "content": f"{article}\n\nWhich river is blue?"}])
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    solo = {
        name: llm.generate([p], params, speculative=spec)[0]
        for name, p in (("long", long_prompt), ("shared", shared))
    }
    engine = llm.new_engine(EngineConfig(max_batch_tokens=64, kv_cache_memory=256 * 2**20, policy=False))
    assert len(long_prompt) > 64
    served = {}
    for name, p in (("long", long_prompt), ("shared", shared)):
        seq = engine.add_request(EngineRequest(name, p, params, parse_speculative(spec)))
        while engine.has_unfinished():
            engine.step()
        served[name] = seq
    assert served["shared"].num_cached_prompt_tokens > 0  # the article's blocks were reused
    for name, seq in served.items():
        assert seq.req.output_ids == solo[name].token_ids, name
        tau, tau_solo = seq.req.stats.mean_accepted_length, solo[name].stats.mean_accepted_length
        assert abs(tau - tau_solo) <= 0.05 * tau_solo, (name, tau, tau_solo)


def test_policy_keeps_plain_and_drafting_overheads_apart() -> None:
    """Steps that verify drafts cost more beyond the forward than plain ones (trees, walks,
    compaction): each kind has its own running overhead, and drafting steps one for each width
    (a policy that granted one token a step must not charge its overhead to three, nor the
    other way round). One slow drafting step fades back to the plain figure while nothing
    drafts, so it cannot stop drafting for good; a width not yet seen is tried."""
    policy = SpeculationPolicy(LatencyCurve(((1, 0.004), (4, 0.006))))
    for _ in range(50):
        policy.observe_step(0.005, 1, 0.0, drafted=False)  # 1 ms beyond a 4 ms forward
    policy.observe_step(0.007 + 0.5, 4, 0.0, drafted=True)  # one drafting step with a 0.5 s pause
    assert abs(policy.overhead - 0.001) < 1e-4 and policy.overhead_at(4) > 0.04
    assert policy.overhead_at(3) == policy.overhead  # unseen: as a plain step
    grant = Candidate(max_draft=3, accept_rates=[0.9, 0.8, 0.7], draft_cost=0.0)
    assert policy.budgets([grant], 1, 8) == [2]  # the pause makes 4 rows look ruinous, not 3
    for _ in range(60):
        policy.observe_step(0.005, 1, 0.0, drafted=False)
    assert policy.budgets([grant], 1, 8) == [3]  # forgotten: all three pay again
    # Widths measured apart: 2 rows cost 20 ms beyond the curve, 4 rows nothing. Charged to every
    # width, the 2-row steps' overhead would keep the request plain (rate 0.048 against 0.05).
    policy = SpeculationPolicy(LatencyCurve(((1, 0.020), (2, 0.024), (4, 0.036))))
    for _ in range(60):
        policy.observe_step(0.024 + 0.020 + 0.006, 2, 0.006, drafted=True)
    policy.observe_step(0.036 + 0.018, 4, 0.018, drafted=True)
    assert policy.overhead_at(2) > 0.019 and policy.overhead_at(4) < 0.0005
    near = Candidate(max_draft=3, accept_rates=[0.9, 0.85, 0.8], draft_cost=0.006)
    assert policy.budgets([near], 1, 8) == [3]
