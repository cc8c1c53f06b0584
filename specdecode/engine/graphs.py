"""Decoding and verification forwards replayed from captured CUDA graphs.

On a GPU a small model's forward over a few new tokens is bound by launching its kernels (dozens
a layer), not by its bytes or its arithmetic: SmolLM2's 30 layers take milliseconds to launch
and tens of microseconds to run. A captured graph launches them all at once. A graph replays
fixed tensors, so each forward is written into buffers of fixed size (`attention.StaticPlan`):
its rows padded to a bucket (`ROW_BUCKETS`: one, 64 rows), the cache slots its rows see bounded
by a bucket of columns (powers of two from `MIN_COLUMNS`), one graph per pair.
Every step without prefill rows goes through them: one request's decoding or verification, or
several requests' in one batch.

The same runner runs its buffers eagerly where it does not capture (`capture=False`, on a CPU):
the path the tests compare with the usual forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.attention import Segment, StaticPlan
from specdecode.engine.paged_cache import PagedCache, PagedKVStorage
from specdecode.models.latency import forward_seconds
from specdecode.models.transformer import Transformer

# Every step is computed as a forward of 64 rows, padded: on a GPU a kernel's order of sums
# follows the tensor's shape (cuBLAS picks a product's kernel by it, a row norm's reduction too),
# so a row's bits would otherwise depend on how many rows its step had, and a verification step
# could break a near-tie otherwise than plain decoding does. It costs a one-token step ~20% on
# an H200 (SmolLM2: 3.2 ms a replay at 1 row, 3.9 ms at 64).
ROW_BUCKETS = (64,)
MIN_COLUMNS = 256
MAX_COLUMNS = 1 << 16  # past this many slots in one step the usual forward runs
# Captured when the engine starts (`GraphRunner.capture_all`), every row bucket for contexts up to
# this many slots; larger buckets when first needed. Captured mid-run, a bucket's graphs cost its
# first steps tens of milliseconds each (SmolLM2 on an H200: three forwards a graph).
STARTUP_COLUMNS = 2048


@dataclass
class _Graph:
    """One bucket's buffers and, where captured, its graph (`out` is what a replay writes)."""

    plan: StaticPlan
    ids: torch.Tensor  # (1, T) long
    positions: torch.Tensor  # (1, T) long
    graph: torch.cuda.CUDAGraph | None = None
    out: torch.Tensor | None = None  # (1, T, C)


class GraphRunner:
    """Forwards of at most `max_rows` new tokens over `storage` (the target's KV blocks), from
    graphs captured per bucket (`capture`), or run eagerly over the same buffers."""

    def __init__(
        self,
        model: Transformer,
        storage: PagedKVStorage,
        capture: bool = True,
        rows: tuple[int, ...] = ROW_BUCKETS,
    ) -> None:
        self.model, self.storage, self.capture, self.rows = model, storage, capture, rows
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None  # shared by every graph

    @property
    def max_rows(self) -> int:
        return self.rows[-1]

    def takes(self, segments: list[Segment]) -> bool:
        """Whether one forward over `segments` fits a bucket: every segment a sequence of this
        storage, `max_rows` rows and `MAX_COLUMNS` slots at most."""
        rows = sum(seg.length for seg in segments)
        columns = sum(seg.start + seg.length for seg in segments)
        return (
            0 < rows <= self.max_rows
            and columns <= MAX_COLUMNS
            and all(getattr(seg.cache, "storage", None) is self.storage for seg in segments)
        )

    def capture_all(self, columns: int = STARTUP_COLUMNS) -> None:
        """Make every row bucket's graph for each column bucket up to `columns` now."""
        c = MIN_COLUMNS
        while c <= min(columns, MAX_COLUMNS):
            for rows in self.rows:
                if (rows, c) not in self.graphs:
                    self._make(rows, c)
            c *= 2

    def forward(
        self,
        ids: torch.Tensor,  # (T,) long, every segment's new tokens in order
        positions: torch.Tensor,  # (T,) long
        segments: list[Segment],
    ) -> torch.Tensor:
        """The rows' hidden states (T, C) after the final norm, their keys and values written to
        their slots (the caches' lengths do not move: the caller commits)."""
        t = ids.shape[0]
        rows = next(r for r in self.rows if r >= t)
        need = sum(seg.start + seg.length for seg in segments)
        columns = max(MIN_COLUMNS, 1 << (need - 1).bit_length())
        g = self.graphs.get((rows, columns)) or self._make(rows, columns)
        g.plan.fill(segments)
        g.ids.zero_()
        g.ids[0, :t] = ids
        g.positions.zero_()
        g.positions[0, :t] = positions
        if g.graph is None:
            out = self.model.forward_plan(g.ids, g.positions, g.plan)
        else:
            g.graph.replay()
            out = g.out
        assert out is not None
        return out[0, :t].clone()  # the next replay overwrites `out`; drafters keep rows

    def seconds(self, widths: list[int], context: int, repeats: int) -> dict[int, list[float]]:
        """`models.latency.forward_seconds` through the graphs (`widths` at most `max_rows`; the
        first of each width captures its bucket's graph where it is new). The storage's pool must
        have the blocks; they are given back."""
        cache = PagedCache(self.storage, context + max(widths))
        try:
            return forward_seconds(
                self.model,
                widths,
                context,
                repeats,
                cache,
                lambda ids, pos, seg: self.forward(ids, pos, [seg]),
            )
        finally:
            cache.release()

    @torch.no_grad()  # the engine may capture outside a step (`capture_all`): no autograd there
    def _make(self, rows: int, columns: int) -> _Graph:
        """The buffers of a bucket, and its graph where this runner captures."""
        s, device = self.storage, self.storage.device
        probe = torch.empty(1, 1, 0, self.model.config.head_dim, dtype=self.model.dtype, device=device)
        by_rows = self.model.kernels.attends(probe)  # (B, H, T, D) queries, no data
        plan = StaticPlan(s.k, s.v, rows, columns, s.scratch, by_rows)
        ids = torch.zeros(1, rows, dtype=torch.long, device=device)
        positions = torch.zeros(1, rows, dtype=torch.long, device=device)
        g = _Graph(plan, ids, positions)
        if self.capture:
            # Warm up on a side stream (library handles, workspaces), then capture. The empty
            # plan's rows write only the scratch slot.
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.model.forward_plan(ids, positions, plan)
            torch.cuda.current_stream(device).wait_stream(side)
            g.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g.graph, pool=self.pool):
                g.out = self.model.forward_plan(ids, positions, plan)
        self.graphs[rows, columns] = g
        return g
