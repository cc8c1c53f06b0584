"""Who runs this step: the waiting queue, the running set, admission, chunked prefill, preemption.

A *sequence* is one request being served. Its cache must hold all its tokens but the last (the
root) before it can take a decoding step; until then it is *prefilling*, one chunk per step.

- Admission (FIFO): the head of the queue joins the running set when a seat is free
  (`max_num_seqs`) and the pool has the blocks for its whole prompt (after prefix reuse) plus its
  first step; otherwise it, and everyone behind it, waits.
- Chunked prefill: prefill chunks only use the rows of the forward that decoding left, so running
  requests keep decoding while a long prompt is read.
- Preemption: when a running sequence cannot get the blocks its next step needs, the youngest
  running sequence gives all its blocks back and returns to the front of the queue, keeping its
  output; re-admitted, it recomputes its cache from prompt + output (often from its own blocks,
  still in the prefix cache).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from specdecode.drafters.base import Drafter
from specdecode.engine.block_pool import BlockPool
from specdecode.engine.paged_cache import PagedCache
from specdecode.outputs import SpecStats
from specdecode.request import Request


@dataclass(eq=False)
class Sequence:
    """A request in the engine: the decoding state (`req`, whose cache is a `PagedCache`), its
    drafter, plus what the engine tracks about it."""

    request_id: str
    req: Request
    drafter: Drafter | None
    method: str  # speculative method name, "none" for plain decoding
    arrival_time: float = field(default_factory=time.perf_counter)
    num_cached_prompt_tokens: int = 0  # prompt tokens whose KV came from reused blocks
    started: bool = False  # the drafter has been told the prompt is cached (`begin`)
    # Running averages of drafting seconds per draft token, by the drafter's way of drafting
    # (`Drafter.source` without its grade: `cost_way`), its drafting steps' counts by way and
    # grade (`Drafter.source`), and the way this step's proposal takes (set when budgets are
    # chosen).
    draft_costs: dict[str, float] = field(default_factory=dict)
    ways: dict[str, SpecStats] = field(default_factory=dict)
    source: str = ""
    idle_steps: int = 0  # decoding steps since the policy last let it draft
    proposals: int = 0  # drafts its drafter was asked for
    return_hidden: bool = False  # return every decided position's hidden state (`EngineRequest`)

    @property
    def cache(self) -> PagedCache:
        return self.req.cache  # type: ignore[return-value]

    @property
    def target_len(self) -> int:
        """Tokens the cache holds before a decoding step: everything but the root."""
        return len(self.req.prompt_ids) + len(self.req.output_ids) - 1

    @property
    def max_step(self) -> int:
        """Rows of its widest decoding step: the root and the most draft tokens."""
        return 1 + (self.drafter.max_nodes if self.drafter is not None else 0)

    def record_tokens(self, now: float) -> None:
        """Time the request's output so far (`Request.timing`), from its arrival."""
        timing = self.req.timing
        since = now - self.arrival_time
        timing.first_token_s = timing.first_token_s or since
        timing.total_s = since
        timing.num_tokens = len(self.req.output_ids)

    @property
    def prefilling(self) -> bool:
        return self.cache.length < self.target_len

    def release(self) -> None:
        """Free the target's blocks and whatever the drafter holds (a draft model's blocks)."""
        self.cache.release()
        if self.drafter is not None:
            self.drafter.release()


class Scheduler:
    """The queue and the running set over one block pool."""

    def __init__(self, pool: BlockPool, max_num_seqs: int, prefix_caching: bool) -> None:
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.prefix_caching = prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is the youngest
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks (its draft model's too)."""
        seq.release()
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)

    def make_room(self, seq: Sequence, num_new: int) -> bool:
        """Get `seq` the blocks for `num_new` more tokens, preempting the youngest running
        sequences (`seq` itself last) if need be; False when `seq` was preempted."""
        while not self.pool.can_allocate(seq.cache.blocks_needed(num_new)):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        seq.release()
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into the running set while seats and blocks allow (FIFO),
        starting each on the reusable blocks of its prefix. Blocks for its widest step are
        required on top of its prompt's."""
        admitted = []
        bs = self.pool.block_size
        free = self.pool.num_free  # less what the sequences admitted here will take
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            ids = seq.req.all_ids[: seq.target_len]
            blocks, last_hash = self.pool.match_prefix(ids) if self.prefix_caching else ([], 0)
            # Its widest step, but never past its own room (a step near the end of the context
            # is cut to what the cache holds), which `add_request` checked the pool can hold.
            total = -(-min(seq.target_len + seq.max_step, seq.req.max_len) // bs)
            need = total - len(blocks) + self.pool.num_free_among(blocks)
            if need > free:
                break
            free -= need
            self.waiting.popleft()
            self.pool.take(blocks)
            seq.cache.adopt(blocks, last_hash)
            if not seq.started:  # a preempted sequence's prompt reuse was counted the first time
                seq.num_cached_prompt_tokens = min(seq.cache.length, len(seq.req.prompt_ids))
            self.running.append(seq)
            admitted.append(seq)
        return admitted
