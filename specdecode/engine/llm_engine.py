"""The engine: many requests on one target model, one batched target forward per step.

Every entry point drives this one engine: `LLM.generate` / `stream` / `chat` (which add their
prompts and step until they finish), the OpenAI-compatible server (through `AsyncEngine`), the
benchmarks and training's self-distillation. A single prompt is a batch of one.

    engine = LLMEngine(model, EngineConfig(), DrafterFactory(model, tokenizer, "smollm2-135m"),
                       eos_token_ids=tokenizer.eos_token_ids)
    engine.add_request(EngineRequest("a", tokenizer.encode("Hello"), SamplingParams(), None))
    while engine.has_unfinished():
        for delta in engine.step(): ...

Each `step` reads like the algorithm: schedule (who decodes, who prefills which chunk, who is
admitted or preempted) -> propose (each decoding request's drafter, within the draft budget the
load policy grants) -> one target forward over every request's rows (decode roots, drafts, side
tokens and prefill chunks, as segments of one row) -> verify each request with the same
`StepPlan.finish` -> commit (append, stats, drafter observe, prefix-cache registration, timing,
finished requests free their blocks). Drafters hear of a cached prompt through one path
(`_begin`), with every prompt row read from the cache's slots (which keep each position's hidden
state beside its keys and values, so reused blocks bring theirs), as `drafters.base` says.

Greedy requests emit exactly the tokens they emit alone: each request's rows attend only to its
own cache (the attention plan's segments), and greedy tokens are the model's exact argmax.
Sampled requests draw from their own seeded generator. A draft model's KV cache is paged too:
one `PagedKVStorage` per draft model (made at its first request) with as many blocks as the
target's pool, each request's draft cache a `PagedCache` over it, freed with the target's blocks
when the request finishes, is aborted or is preempted (`Drafter.release`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

import torch

from specdecode.attention import AttentionPlan, Segment
from specdecode.drafters.base import Drafter, cost_way
from specdecode.engine.config import EngineConfig
from specdecode.engine.drafter_factory import DrafterFactory
from specdecode.engine.graphs import GraphRunner
from specdecode.engine.paged_cache import PagedCache, PagedKVStorage
from specdecode.engine.policy import (
    COST_SAMPLES,
    EMA,
    FORGET,
    PROBE_STEPS,
    Candidate,
    LatencyCurve,
    SpeculationPolicy,
    accept_rates,
)
from specdecode.engine.scheduler import Scheduler, Sequence
from specdecode.errors import SpecDecodeError
from specdecode.models.latency import forward_seconds
from specdecode.models.transformer import Transformer
from specdecode.outputs import SpecStats, Timing
from specdecode.request import Proposal, Request, RowSlice, StepPlan, StepResult, step_logprobs
from specdecode.sampling import SamplingParams, TokenLogprobs
from specdecode.spec_config import DraftModelConfig, LookaheadConfig, PromptLookupConfig, SpecConfig
from specdecode.tree import DraftTree

__all__ = ["EngineConfig", "EngineRequest", "EngineStats", "Histogram", "LLMEngine", "RequestDelta"]


@dataclass
class EngineRequest:
    """One generation to serve. `speculative` is already parsed (`parse_speculative`); None = plain.
    A caller whose user did not choose passes the engine's default, `EngineConfig.speculative`."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    speculative: SpecConfig | None
    arrival_time: float | None = None
    # Return the target's hidden state (after the final norm) of every decided position: the
    # request's `hidden_states` (L-1, C) when it finishes, for training data (read from the
    # cache's slots, which keep them for reused prompt blocks too).
    return_hidden: bool = False


@dataclass
class RequestDelta:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    num_prompt_tokens: int
    num_cached_prompt_tokens: int  # prompt tokens served from reused KV blocks
    stats: SpecStats  # cumulative for the request
    logprobs: list[TokenLogprobs] | None = None  # one per new token when the request asked
    timing: Timing | None = None  # the request's timing so far (a copy)


# Upper bounds (seconds) of the latency histograms' buckets, as Prometheus histograms count them.
# The load policy's latency curve is measured up to this many rows (extended linearly past them:
# by then a forward is bound by its arithmetic), at the first step that asks for draft budgets.
CURVE_ROWS = 128
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0)


@dataclass
class Histogram:
    """Observations counted in cumulative buckets (`counts[i]`: those <= `bounds[i]`), their sum
    and their number."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        self.total += value
        self.count += 1
        for i, bound in enumerate(self.bounds):
            self.counts[i] += value <= bound


@dataclass
class EngineStats:
    """Live counters of the engine (the server's metrics)."""

    num_requests: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_waiting: int = 0
    num_running: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_reused: int = 0
    draft_kv_blocks_total: int = 0  # over every draft model's storage
    draft_kv_blocks_used: int = 0
    drafts_proposed: dict[str, int] = field(default_factory=dict)
    drafts_accepted: dict[str, int] = field(default_factory=dict)
    accepted_by_position: dict[str, list[int]] = field(default_factory=dict)
    proposed_by_position: dict[str, list[int]] = field(default_factory=dict)  # steps offering position i
    reached_by_position: dict[str, list[int]] = field(default_factory=dict)  # ... with all before accepted
    # The same counts for each way a method drafts (`Drafter.source`; "" for a drafter of one
    # way): what the load policy's acceptance estimates read.
    ways: dict[tuple[str, str], SpecStats] = field(default_factory=dict)
    # Each method's drafting seconds per draft token, over its requests, for each of its ways of
    # drafting (`Drafter.source` without its grade, `cost_way`; "" for a drafter of one way):
    # the lower median of its last COST_SAMPLES proposals' figures (`record_cost`), so that one
    # slow `propose` (a pause, a neighbour on the machine) cannot make the method look costly to
    # every request after it.
    draft_cost: dict[tuple[str, str], float] = field(default_factory=dict)
    draft_cost_samples: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    # Seconds from a request's arrival to its first token, and per output token after the first
    # (each finished request's decode time / its tokens after the first).
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    time_per_output_token: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))
    # Decoding steps (no prompt rows in their forward) by the rows their forward ran: [steps,
    # seconds of the whole step (drafting and verifying included), seconds of its target
    # forward (the layers; the LM head is read in verifying; on a GPU the forward's launches,
    # its kernels finishing in verifying, which waits for them)]. What a step verifying drafts
    # costs here beside a one-row step, the other half of a method's speedup besides its tau,
    # and how much of that is the forward.
    decode_steps: dict[int, list[float]] = field(default_factory=dict)

    def record_step(self, rows: int, seconds: float, forward_seconds: float) -> None:
        """One decoding step of `rows` rows that took `seconds`, `forward_seconds` of them in
        the target's forward."""
        counts = self.decode_steps.setdefault(rows, [0, 0.0, 0.0])
        counts[0] += 1
        counts[1] += seconds
        counts[2] += forward_seconds

    def record_cost(self, method: str, source: str, seconds_per_token: float) -> None:
        """One proposal's drafting seconds per draft token, into its method's estimate for the
        way it drafted (`source`)."""
        samples = self.draft_cost_samples.setdefault((method, source), [])
        samples.append(seconds_per_token)
        del samples[:-COST_SAMPLES]
        self.draft_cost[method, source] = sorted(samples)[(len(samples) - 1) // 2]

    def record_draft(self, method: str, result: StepResult, num_accepted: int) -> None:
        """Count one speculative step of a request using `method`."""
        self.drafts_proposed[method] = self.drafts_proposed.get(method, 0) + result.num_draft
        self.drafts_accepted[method] = self.drafts_accepted.get(method, 0) + num_accepted
        proposed = self.proposed_by_position.setdefault(method, [])
        accepted = self.accepted_by_position.setdefault(method, [])
        reached = self.reached_by_position.setdefault(method, [])
        grow = result.max_depth - len(proposed)
        if grow > 0:
            proposed += [0] * grow
            accepted += [0] * grow
            reached += [0] * grow
        for d in range(result.max_depth):
            proposed[d] += 1
            accepted[d] += d < num_accepted
            reached[d] += d <= num_accepted


def _fixed_budget(seq: Sequence) -> int | None:
    """The draft budget of a request the load policy does not weigh (see
    `LLMEngine._draft_budgets`): 0 when it cannot draft, its method's whole proposal when it is a
    seeded sampled request; None for the others."""
    if seq.drafter is None or seq.max_step <= 1:
        return 0
    params = seq.req.params
    return seq.max_step - 1 if params.seed is not None and not params.greedy else None


class LLMEngine:
    """Runs requests on `model` with in-flight batching, a paged KV cache with prefix reuse and
    per-request speculation (under the load policy when `config.policy`). `drafters` builds each
    request's drafter (None: a factory without tokenizer or shipped heads); `eos_token_ids` end
    every request that does not ignore them. Not thread-safe: one thread calls `add_request`,
    `abort` and `step` (the server's `AsyncEngine` does)."""

    def __init__(
        self,
        model: Transformer,
        config: EngineConfig | None = None,
        drafters: DrafterFactory | None = None,
        eos_token_ids: SequenceOf[int] = (),
    ) -> None:
        self.model = model
        self.config = config = config or EngineConfig()
        self.drafters = drafters or DrafterFactory(model)
        self.eos_token_ids = list(eos_token_ids)
        self.device = self.model.device
        self.draft_storages: dict[Transformer, PagedKVStorage] = {}  # made at first use
        self.kv_dtype = self._kv_dtype()
        num_blocks = self._num_blocks()
        self.storage = PagedKVStorage(
            self.model.config,
            num_blocks,
            config.block_size,
            self.model.dtype,
            self.device,
            kv_dtype=self.kv_dtype,
        )
        self.pool = self.storage.pool
        # Steps without prefill rows replay captured CUDA graphs (on a GPU, where the config allows).
        self.graphs = None
        if config.cuda_graphs and self.device.type == "cuda":
            self.graphs = GraphRunner(model, self.storage)
            self.graphs.capture_all()
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.prefix_caching)
        self.sequences: dict[str, Sequence] = {}
        self.policy: SpeculationPolicy | None = None
        if config.policy:
            curve = config.latency_curve
            self.policy = SpeculationPolicy(
                LatencyCurve(curve)
                if curve is not None
                else lambda: LatencyCurve.measure(
                    self.model, min(config.max_batch_tokens, CURVE_ROWS), timer=self.forward_seconds
                )
            )
        self.stats = EngineStats(kv_blocks_total=num_blocks)

    def _kv_dtype(self) -> torch.dtype:
        """The dtype of the target's keys and values (`EngineConfig.kv_cache_dtype`)."""
        name = self.config.kv_cache_dtype
        dtype = self.model.dtype if name == "auto" else getattr(torch, name)
        if dtype != self.model.dtype and self.device.type != "cpu":
            raise SpecDecodeError(
                f"kv_cache_dtype {name} with a {str(self.model.dtype).removeprefix('torch.')} model runs on "
                "the CPU only: on a GPU the cache is kept in the model's dtype (kv_cache_dtype='auto')"
            )
        return dtype

    def _num_blocks(self) -> int:
        """Blocks in the memory budget; by default a fraction of the memory free now, and no more
        than `max_num_seqs` requests of the model's full context could use. When the default
        speculative method drafts with a model, the budget holds that many blocks of the draft
        model too (its storage has as many blocks as the target's pool)."""
        cfg = self.config
        per_block = PagedKVStorage.block_bytes(
            self.model.config, cfg.block_size, self.model.dtype, kv_dtype=self.kv_dtype
        )
        spec = cfg.speculative
        if isinstance(spec, DraftModelConfig | PromptLookupConfig) and spec.draft_model is not None:
            draft = self.drafters.draft_model(spec.draft_model, spec.draft_dtype)
            per_block += PagedKVStorage.block_bytes(draft.config, cfg.block_size, draft.dtype, hidden=False)
        if cfg.kv_cache_memory is not None:
            num = cfg.kv_cache_memory // per_block
            if num < 1:
                raise SpecDecodeError(
                    f"kv_cache_memory of {cfg.kv_cache_memory} bytes is less than one KV block "
                    f"({per_block} bytes)"
                )
            return num
        context_blocks = -(-self.model.config.max_position_embeddings // cfg.block_size)
        num = int(cfg.kv_cache_fraction * _free_memory(self.device)) // per_block
        return max(1, min(num, cfg.max_num_seqs * context_blocks))

    def forward_seconds(self, widths: list[int], context: int, repeats: int) -> dict[int, list[float]]:
        """`models.latency.forward_seconds` as this engine runs its steps: through its CUDA graphs
        for the widths they hold, the model's forward for others, over blocks of its own storage
        (keys and values in its `kv_dtype`) where the pool has them free."""

        def fits(tokens: int) -> bool:  # the pool has free blocks for that many tokens
            return self.pool.can_allocate(-(-tokens // self.config.block_size))

        out: dict[int, list[float]] = {}
        graphed = [t for t in widths if self.graphs is not None and t <= self.graphs.max_rows]
        if graphed and fits(context + max(graphed)):
            assert self.graphs is not None
            out = self.graphs.seconds(graphed, context, repeats)
        rest = [t for t in widths if t not in out]
        if not rest:
            return out
        if not fits(context + max(rest)):
            return out | forward_seconds(self.model, rest, context, repeats)
        cache = PagedCache(self.storage, context + max(rest), prefix_caching=False)
        try:
            return out | forward_seconds(self.model, rest, context, repeats, cache)
        finally:
            cache.release()

    # ---- requests ------------------------------------------------------------------------------

    def add_request(self, req: EngineRequest, drafter: Drafter | None = None) -> Sequence:
        """Queue a request after checking it; bad input raises `SpecDecodeError` naming the field.
        `drafter` is one the caller built itself (tests, experiments) instead of the factory's
        for `req.speculative`. Returns the engine's record of the request."""
        if req.request_id in self.sequences:
            raise SpecDecodeError(f"request_id {req.request_id!r} is already in use")
        if not isinstance(req.prompt_ids, list) or not all(isinstance(t, int) for t in req.prompt_ids):
            raise SpecDecodeError("prompt_ids must be a list of token ids")
        spec = req.speculative
        default = self.config.speculative
        if isinstance(spec, LookaheadConfig) and isinstance(default, LookaheadConfig):
            spec.check_within(default)
        if drafter is None:
            drafter = self.drafters.build(spec, self._draft_cache)
        request = Request(
            self.model,
            req.prompt_ids,
            req.params,
            self.eos_token_ids,
            drafter.max_nodes if drafter is not None else 0,
            new_cache=lambda max_len: PagedCache(self.storage, max_len),
        )
        need = -(-request.max_len // self.config.block_size)
        if need > self.pool.num_blocks:
            raise SpecDecodeError(
                f"prompt_ids and max_tokens need {need} KV blocks but the cache holds "
                f"{self.pool.num_blocks}; "
                "raise kv_cache_memory or lower max_tokens"
            )
        method = "none" if drafter is None else spec.method if spec is not None else type(drafter).__name__
        arrival = req.arrival_time if req.arrival_time is not None else time.perf_counter()
        seq = Sequence(req.request_id, request, drafter, method, arrival, return_hidden=req.return_hidden)
        self.sequences[req.request_id] = seq
        self.scheduler.add(seq)
        self.stats.num_requests += 1
        self.stats.num_prompt_tokens += len(req.prompt_ids)
        self._update_gauges()
        return seq

    def _draft_cache(self, draft: Transformer, max_len: int) -> PagedCache:
        """A request's KV cache for `draft`, over that draft model's block storage (reusing its
        blocks of an earlier request's tokens under the engine's `prefix_caching`)."""
        storage = self.draft_storages.get(draft)
        if storage is None:
            storage = PagedKVStorage(
                draft.config,
                self.pool.num_blocks,
                self.config.block_size,
                draft.dtype,
                draft.device,
                hidden=False,
            )
            self.draft_storages[draft] = storage
        return PagedCache(
            storage, min(max_len, draft.config.max_position_embeddings), self.config.prefix_caching
        )

    def abort(self, request_id: str, finished: bool = False) -> None:
        """Drop a request and free its blocks now (no delta is emitted for it); unknown ids are
        ignored. `finished`: the caller ended it on purpose (its text met a stop string), so it
        counts as finished, not aborted."""
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return
        self.scheduler.remove(seq)
        if finished:
            self.stats.num_finished += 1
        else:
            self.stats.num_aborted += 1
        self._update_gauges()

    def has_unfinished(self) -> bool:
        return bool(self.sequences)

    def clear_prefix_cache(self) -> None:
        """Forget the cached prefixes of free blocks (blocks in use keep theirs)."""
        self.pool.clear_prefix_cache()

    # ---- the step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestDelta]:
        """One iteration: schedule -> propose -> one batched target forward -> verify -> commit."""
        t0 = time.perf_counter()
        curve_known = self.policy is not None and self.policy.measured
        budget = self.config.max_batch_tokens
        running = self.scheduler.running

        # Decoding requests: propose within their draft budgets, reserve their rows.
        decoding = [s for s in running if not s.prefilling]
        pending = sum(s.target_len - s.cache.length for s in running if s.prefilling)
        draft_budgets = self._draft_budgets(decoding, min(budget, len(decoding) + pending))
        plans: list[tuple[Sequence, StepPlan, Segment]] = []
        draft_seconds = 0.0
        for seq, k in zip(decoding, draft_budgets, strict=True):
            if seq not in running or budget <= 0:  # preempted for an older request / batch full
                continue
            k = min(k, budget - 1)
            req = seq.req
            if not seq.started:  # its whole prompt came from the prefix cache
                self._begin(seq)
            proposal = None
            if k > 0 and seq.drafter is not None:
                tp = time.perf_counter()
                # Drafters shape their work to the budget, but a seeded sampled request's draws
                # (its text) must not depend on it: it proposes in full, then is trimmed.
                seeded = req.params.seed is not None and not req.params.greedy
                proposal = trim(seq.drafter.propose(req, None if seeded else k), k)
                spent = time.perf_counter() - tp
                draft_seconds += spent
                seq.proposals += 1
                if seq.proposals > 1:
                    # Not a request's first proposal: that one holds the drafter's work on the
                    # prompt (a draft model's prefill: 13 ms a token instead of 7 for the Qwen
                    # 0.5B). The next figure is taken whole: averaged in from zero, a draft model's
                    # forwards looked cheap for its request's first ten steps.
                    way = cost_way(seq.source)
                    cost = seq.draft_costs.get(way, 0.0)
                    seq.draft_costs[way] = cost + (EMA if cost > 0 else 1.0) * (spent / k - cost)
                    self.stats.record_cost(seq.method, way, spent / k)
                seq.idle_steps = 0
            elif seq.drafter is not None:
                # Not measured this step: let the estimate drift to its method's, so that one slow
                # `propose` (a pause, a first-call index build) cannot keep a request from drafting
                # for good. (Fading to zero instead made drafters that cost more than they gain
                # look free again after a few plain steps: they drafted one step in four at a loss.)
                # A request that never drafted has no figure of its own (0: its method's is used);
                # drifting it up from zero made a costly drafter look nearly free for a while.
                for source, cost in seq.draft_costs.items():
                    method = self.stats.draft_cost.get((seq.method, source), cost)
                    seq.draft_costs[source] = cost + EMA * (method - cost)
                seq.idle_steps += 1
            plan = StepPlan.prepare(req, proposal, self.device)
            if not self.scheduler.make_room(seq, plan.length):
                continue
            plans.append((seq, plan, plan.segment(seq.cache)))
            budget -= plan.length

        # Prefill chunks in the rows left, for running requests first, then newly admitted ones.
        if budget > 0:
            self.scheduler.admit()
        chunks: list[tuple[Sequence, Segment]] = []
        for seq in list(running):
            if budget <= 0 or seq not in running or not seq.prefilling or any(seq is p[0] for p in plans):
                continue
            n = min(budget, seq.target_len - seq.cache.length)
            # Out of blocks: wait, or, when no decoding step holds rows, preempt to make progress.
            short = not self.pool.can_allocate(seq.cache.blocks_needed(n))
            if short and (plans or not self.scheduler.make_room(seq, n)):
                continue
            chunks.append((seq, Segment.append(seq.cache, n)))
            budget -= n

        deltas: list[RequestDelta] = []
        forward_seconds = 0.0
        if plans or chunks:
            tf = time.perf_counter()
            hidden = self._forward(plans, chunks)
            forward_seconds = time.perf_counter() - tf
            deltas = self._commit(plans, chunks, hidden)
        rows = sum(p[1].length for p in plans) + sum(c[1].length for c in chunks)
        if self.policy is not None and plans and curve_known:  # not the step that measured it
            drafted = any(p[1].length > 1 for p in plans)
            self.policy.observe_step(time.perf_counter() - t0, rows, draft_seconds, drafted)
        measured_now = self.policy is not None and not curve_known and self.policy.measured
        if plans and not chunks and not measured_now:  # not the step that timed the latency curve
            self.stats.record_step(rows, time.perf_counter() - t0, forward_seconds)
        self._update_gauges()
        return deltas

    def _draft_budgets(self, decoding: list[Sequence], base_tokens: int) -> list[int]:
        """Draft tokens each decoding request may verify: the policy's choice, or without the
        policy its drafter's maximum, within the step's rows."""
        rows = self.config.max_batch_tokens
        if self.policy is None:
            out, left = [], rows - len(decoding)
            for seq in decoding:
                k = min(seq.max_step - 1, max(left, 0))
                out.append(k)
                left -= k
            return out
        # The policy weighs only requests that can draft. A seeded sampled request drafts its
        # method's whole proposal: budgets chosen from measured times would make the random draws
        # it consumes, hence its text, vary run to run.
        fixed = [_fixed_budget(seq) for seq in decoding]
        base_tokens += sum(k for k in fixed if k is not None)
        candidates = []
        for seq in [s for s, k in zip(decoding, fixed, strict=True) if k is None]:
            assert seq.drafter is not None
            # What a chain is worth and costs depends on the way it is drafted (a lookup branch's
            # copy from the text, or its head's guess): each way has its counts, its cost and its
            # limit (a copy after a short match: `Drafter.way_limit`).
            seq.source = seq.drafter.source(seq.req)
            depth = min(seq.max_step - 1, seq.drafter.max_chain)  # a tree drafter's chain, budgeted
            limit = seq.drafter.way_limit(seq.source)
            if limit is not None:
                depth = min(depth, limit)
            way = seq.method, seq.source
            own, method = seq.ways.get(seq.source) or SpecStats(), self.stats.ways.get(way) or SpecStats()
            rates = accept_rates(
                own.reached_by_position,
                own.accepted_by_position,
                method.reached_by_position,
                method.accepted_by_position,
                depth,
                FORGET**seq.idle_steps,
            )
            # Costs are kept per way, its grade left off: a copy costs the same whatever its match.
            cost_key = cost_way(seq.source)
            cost = seq.draft_costs.get(cost_key) or self.stats.draft_cost.get((seq.method, cost_key), 0.0)
            candidates.append(Candidate(depth, rates, cost))
        chosen = iter(self.policy.budgets(candidates, base_tokens, rows) if candidates else [])
        out = [next(chosen) if k is None else k for k in fixed]
        # A request kept plain for PROBE_STEPS steps drafts one token: its method's cost and
        # acceptance are measured anew, so estimates that went wrong (a pause while it drafted,
        # a text that turned repetitive) cannot keep it plain for good; where drafting does not
        # pay, the probe costs one row every PROBE_STEPS steps.
        left = rows - base_tokens - sum(out)
        for i, seq in enumerate(decoding):
            if left > 0 and fixed[i] is None and out[i] == 0 and seq.idle_steps >= PROBE_STEPS:
                out[i], left = 1, left - 1
        return out

    def _forward(
        self, plans: list[tuple[Sequence, StepPlan, Segment]], chunks: list[tuple[Sequence, Segment]]
    ) -> torch.Tensor:
        """One target forward over every plan's rows then every prefill chunk; hidden (T, C)."""
        ids: list[torch.Tensor] = []
        positions: list[torch.Tensor] = []
        for _, plan, seg in plans:
            ids.append(plan.ids)
            positions.append(seg.start + plan.depths)
        for seq, seg in chunks:
            ids.append(torch.tensor(seq.req.all_ids[seg.start : seg.start + seg.length], device=self.device))
            positions.append(torch.arange(seg.start, seg.start + seg.length, device=self.device))
        segments = [p[2] for p in plans] + [c[1] for c in chunks]
        plan = AttentionPlan(segments, prefill_from=sum(p[1].length for p in plans))
        if self.graphs is not None and not chunks and self.graphs.takes(segments):
            hidden = self.graphs.forward(torch.cat(ids), torch.cat(positions), segments)
        else:
            hidden = self.model.forward_plan(torch.cat(ids)[None], torch.cat(positions)[None], plan)[0]
        plan.commit()  # the runner, not the forward, moves the caches past the new rows
        at = 0
        for seq, seg in [(s, g) for s, _, g in plans] + chunks:  # each row's hidden beside its KV
            seq.cache.write_hidden(seg.start, hidden[at : at + seg.length])
            at += seg.length
        return hidden

    def _commit(
        self,
        plans: list[tuple[Sequence, StepPlan, Segment]],
        chunks: list[tuple[Sequence, Segment]],
        hidden: torch.Tensor,  # (T, C)
    ) -> list[RequestDelta]:
        """Verify each plan, emit its tokens, finish requests, register full blocks."""
        offsets, at = [], 0
        for _, plan, _ in plans:
            offsets.append(at)
            at += plan.length
        # One screening pass of the LM head over every greedy request's rows, not one per request:
        # each request then resolves exact tokens along its own accepted path only.
        greedy = [i for i, (seq, _, _) in enumerate(plans) if seq.req.params.greedy]
        screened: dict[int, SequenceOf[int]] = {}
        if greedy:
            rows_of = [torch.arange(offsets[i], offsets[i] + plans[i][1].length) for i in greedy]
            best = self.model.greedy_rows(hidden[torch.cat(rows_of)])
            at_row = 0
            for i in greedy:
                screened[i] = RowSlice(best, at_row, plans[i][1].length)
                at_row += plans[i][1].length
        deltas = []
        for i, (seq, plan, seg) in enumerate(plans):
            req = seq.req
            rows = hidden[offsets[i] : offsets[i] + plan.length]  # (T_i, C)
            verifier = seq.drafter.sampling_verifier if seq.drafter is not None else None
            emitted, result = plan.finish(self.model, req, seg.start, rows, screened.get(i), verifier)
            tokens = req.commit(emitted, result, step_logprobs(self.model, req, rows, emitted, result))
            finished = req.finish_reason is not None
            if result is not None:
                accepted = min(result.verdict.num_draft_accepted, len(tokens))
                self.stats.record_draft(seq.method, result, accepted)
                way = self.stats.ways.setdefault((seq.method, seq.source), SpecStats())
                for counts in (seq.ways.setdefault(seq.source, SpecStats()), way):
                    counts.record_step(result.max_depth, result.num_draft, accepted, len(tokens))
                if not finished:
                    seq.drafter.observe(req, result)  # type: ignore[union-attr]
            elif seq.drafter is not None and not finished and tokens:
                # A plain step of a request that drafts (the policy gave it no budget, or its
                # drafter proposed nothing): its drafter still hears of the token and the root's
                # row, or a head reading the target's features would draft from a stale one.
                seq.drafter.observe(req, StepResult.plain(tokens[0], rows))
            self.stats.num_generated_tokens += len(tokens)
            first = not req.timing.first_token_s
            seq.record_tokens(time.perf_counter())
            if first:
                self.stats.time_to_first_token.observe(req.timing.first_token_s)
            if finished:
                if seq.return_hidden:  # the compacted cache holds the decided positions' rows
                    req.hidden_states = seq.cache.hidden(len(req.all_ids) - 1)
                if req.timing.num_tokens > 1:
                    span = req.timing.total_s - req.timing.first_token_s
                    self.stats.time_per_output_token.observe(span / (req.timing.num_tokens - 1))
                self._finish(seq)
            elif self.config.prefix_caching:
                seq.cache.register_full_blocks(req.all_ids)
            deltas.append(
                RequestDelta(
                    seq.request_id,
                    tokens,
                    finished,
                    req.finish_reason,
                    len(req.prompt_ids),
                    seq.num_cached_prompt_tokens,
                    _snapshot(req.stats),
                    None if req.logprobs is None else req.logprobs[len(req.logprobs) - len(tokens) :],
                    dataclasses.replace(req.timing),
                )
            )
        for seq, _ in chunks:
            if self.config.prefix_caching:
                seq.cache.register_full_blocks(seq.req.all_ids)
            if not seq.prefilling and not seq.started:
                self._begin(seq)
        return deltas

    def _begin(self, seq: Sequence) -> None:
        """The one place a drafter hears that its prompt is cached (`Drafter.begin`'s contract):
        with the hidden rows of every prompt position but the root, read from the cache's slots,
        whether this admission computed them or reused their blocks."""
        req = seq.req
        req.timing.prefill_s = time.perf_counter() - seq.arrival_time
        if seq.drafter is not None:
            seq.drafter.begin(req, seq.cache.hidden(len(req.prompt_ids) - 1))  # (P-1, C)
        seq.started = True

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        del self.sequences[seq.request_id]
        self.stats.num_finished += 1

    def _update_gauges(self) -> None:
        s = self.stats
        s.num_waiting = len(self.scheduler.waiting)
        s.num_running = len(self.scheduler.running)
        s.kv_blocks_used = self.pool.num_used
        s.kv_blocks_reused = self.pool.num_reused
        s.draft_kv_blocks_total = sum(d.pool.num_blocks for d in self.draft_storages.values())
        s.draft_kv_blocks_used = sum(d.pool.num_used for d in self.draft_storages.values())
        s.num_preemptions = self.scheduler.num_preemptions


def trim(proposal: Proposal, k: int) -> Proposal:
    """At most `k` draft tokens of `proposal`: side tokens go first (they only pay as a whole
    window), then the tree keeps its first k nodes (a topological prefix is still a tree)."""
    tree = proposal.tree
    if tree.num_nodes + proposal.num_side <= k:
        return proposal
    if tree.num_nodes <= k:
        return Proposal(tree)
    probs = None if tree.draft_probs is None else tree.draft_probs[:k]
    return Proposal(DraftTree(tree.tokens[:k], tree.parents[:k], probs))


def _snapshot(stats: SpecStats) -> SpecStats:
    """A copy the caller may keep while the request's own figures move on."""
    return dataclasses.replace(
        stats,
        proposed_by_position=list(stats.proposed_by_position),
        accepted_by_position=list(stats.accepted_by_position),
        reached_by_position=list(stats.reached_by_position),
    )


def _free_memory(device: torch.device) -> int:
    """Bytes free now: on the GPU for CUDA, else the RAM the kernel reports as available."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
