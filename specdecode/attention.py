"""Which cache slots each new token of a forward sees: the explicit attention description.

A forward's new tokens are laid out as one row of `T` tokens, split into *segments*, one per
sequence (a single request, or every request of an in-flight batch). Each segment writes its
keys/values into its own cache at `start` and attends to that cache's first `start + length`
slots under its own mask: a causal chain (prefill, plain decoding) or any tree (verification).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdecode.kernels import AttendRows, Kernels, apply_rotary
from specdecode.kv_cache import SequenceCache

# Segments of at most this many new tokens (decoding, verification) attend through the row
# kernel where the model's kernels have one, straight from the cache; longer ones (prefill
# chunks) through SDPA's blocked kernels, but for a prompt's first chunks: up to
# PREFILL_KERNEL_ROWS rows ending within its first PREFILL_KERNEL_CONTEXT positions take the row
# kernel too (and with it the one-call decoder), whose rows read each span of keys once for all
# that share it. Int8, 2 threads, Zen 4, one prompt: SmolLM2 200 / 600 / 1024 tokens 147 / 512 /
# 1205 ms -> 127 / 467 / 1092; Qwen 1.5B 500 tokens 3452 -> 2816 ms. With spans of 64, past
# ~1500 positions SDPA was faster (SmolLM2 2048 tokens: 3108 ms against 3475). With spans of 256
# and a prompt's last spans shared (session 34, int8, 2 threads, AVX-512 Xeon, every chunk through
# the kernel against chunks past 1024 through SDPA, alternated): SmolLM2 1500 / 2048 / 3000 /
# 5000 tokens 0.90x / 0.85x / 0.93x / 1.03x the time, Qwen 1.5B 2048 tokens 1.02x.
KERNEL_MAX_ROWS = 64
PREFILL_KERNEL_ROWS = 512
PREFILL_KERNEL_CONTEXT = 2048


def row_kernel_takes(seg: Segment) -> bool:
    """Whether `seg`'s length and place suit the row kernel (see `KERNEL_MAX_ROWS` above)."""
    early = seg.length <= PREFILL_KERNEL_ROWS and seg.start + seg.length <= PREFILL_KERNEL_CONTEXT
    return seg.length <= KERNEL_MAX_ROWS or early


def causal_mask(start: int, t: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(T, start+T) bool: new token i sees the cached prefix and new tokens 0..i."""
    cols = torch.arange(start + t, device=device)
    rows = torch.arange(t, device=device).unsqueeze(1) + start
    return cols <= rows


def tree_mask(start: int, ancestors: torch.Tensor) -> torch.Tensor:
    """(T, start+T) bool from a tree's (T, T) ancestor-or-self mask: every new token sees the whole
    cached prefix, and among the new tokens only its own root-to-node path."""
    t = ancestors.shape[0]
    prefix = torch.ones(t, start, dtype=torch.bool, device=ancestors.device)
    return torch.cat([prefix, ancestors.bool()], dim=1)


@dataclass(frozen=True)
class Segment:
    """`length` new tokens of one sequence, stored at slots `start..start+length-1` of `cache`.

    `mask` (length, start+length) bool, True = attend; None means a causal chain, which at
    `start == 0` uses the fused causal kernel and otherwise an explicit mask built once here.
    """

    cache: SequenceCache
    start: int
    length: int
    mask: torch.Tensor | None = None

    def slots_seen(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot of each position 0 .. start+length-1 (start+T,) and which of them each new
        token sees (T, start+T) bool (its causal or tree mask)."""
        table = self.cache.slot_table(self.start + self.length)
        mask = self.mask if self.mask is not None else causal_mask(self.start, self.length, table.device)
        return table, mask

    def row_slots(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The segment's rows as a row kernel reads them: each row's own slot (T,), how many slots
        it sees (T,), and those slots in position order, row after row (nnz,)."""
        if self.mask is None and self.length == 1:  # a decoding step's one row sees every slot
            table = self.cache.slot_table(self.start + 1)  # (start+1,)
            return table[self.start :], torch.full((1,), self.start + 1, device=table.device), table
        table, mask = self.slots_seen()
        return table[self.start :], mask.sum(1), table.expand(self.length, -1)[mask]

    @classmethod
    def append(cls, cache: SequenceCache, length: int, mask: torch.Tensor | None = None) -> Segment:
        """A segment of `length` tokens after the cache's valid prefix."""
        start = cache.reserve(length)
        if mask is None and length > 1 and start > 0:
            mask = causal_mask(start, length, cache.device)
        return cls(cache, start, length, mask)


class AttentionPlan:
    """The segments of one forward, in the order their tokens appear in the input row.

    The forward writes each segment's keys/values into its slots; the caches' lengths move only
    when the runner calls `commit` after it (a forward has no side effect on bookkeeping).

    `prefill_from`: the first row of the prompts' chunks, where the runner knows it (the rows
    before are a decoding step's, which must be computed alike in any batch); None lets the
    layers judge by the number of rows (`layers.linear.prefill_rows`)."""

    def __init__(self, segments: list[Segment], prefill_from: int | None = None) -> None:
        self.segments = segments
        self.prefill_from = prefill_from
        self.total = sum(s.length for s in segments)
        self._rows: _KernelRows | None = None  # the kernel's rows, laid out at the first layer
        self._laid_out = False

    def kernel_rows(
        self, kernels: Kernels, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> _KernelRows | None:
        """The rows laid out for the row-attention kernel when it takes every segment (queries of
        `head_dim`, `dtype` on `device`), else None: the forward can then run as one kernel call."""
        probe = torch.empty(1, 1, 0, head_dim, dtype=dtype, device=device)  # (B, H, T, D), no data
        if not self._laid_out:
            self._rows, self._laid_out = _KernelRows.build(self.segments, probe, kernels), True
        rows = self._rows
        return rows if rows is not None and all(rows.fast) else None

    def attend(
        self,
        layer: int,
        q: torch.Tensor,  # (B, H, T, D), before rotary
        k: torch.Tensor,  # (B, H_kv, T, D), before rotary
        v: torch.Tensor,  # (B, H_kv, T, D)
        cos: torch.Tensor,  # (B, 1, T, D) rotary tables at each token's position
        sin: torch.Tensor,  # (B, 1, T, D)
        kernels: Kernels,
    ) -> torch.Tensor:
        """Rotate queries and keys, store every segment's keys/values and return the attention
        output (B, H, T, D), through `kernels`' row attention where it takes the segments."""
        if not self._laid_out:
            self._rows, self._laid_out = _KernelRows.build(self.segments, q, kernels), True
        if self._rows is not None:
            return self._attend_kernel(self._rows, layer, q, k, v, cos, sin)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if len(self.segments) == 1:
            return self._attend_one(self.segments[0], layer, q, k, v)
        outs, s = [], 0
        for seg in self.segments:
            e = s + seg.length
            outs.append(self._attend_one(seg, layer, q[:, :, s:e], k[:, :, s:e], v[:, :, s:e]))
            s = e
        return torch.cat(outs, dim=2)

    def _attend_kernel(
        self,
        rows: _KernelRows,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """The short segments through the row kernel in one call (rotary applied inside), the
        others through SDPA."""
        b, h, t, d = q.shape
        out = torch.empty(b, t, h, d, dtype=q.dtype, device=q.device)  # (1, T, H, D): o reads it as it is
        cache_k, cache_v = rows.cache.layer_slots(layer)  # type: ignore[misc]
        rows.kernel(
            q[0], k[0], v[0], cache_k, cache_v, rows.rows, rows.new_slots, rows.row_ptr, rows.idx, out[0],
            cos[0, 0], sin[0, 0],
        )  # fmt: skip
        s = 0
        for seg, fast in zip(self.segments, rows.fast, strict=True):
            e = s + seg.length
            if not fast:
                c, n = cos[:, :, s:e], sin[:, :, s:e]
                qs, ks = apply_rotary(q[:, :, s:e], c, n), apply_rotary(k[:, :, s:e], c, n)
                part = self._attend_one(seg, layer, qs, ks, v[:, :, s:e])
                out[:, s:e] = part.transpose(1, 2)
            s = e
        return out.transpose(1, 2)

    @staticmethod
    def _attend_one(
        seg: Segment, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        keys, values = seg.cache.write(layer, k, v, seg.start)  # (B, H_kv, start+T, D)
        gqa = q.shape[1] != k.shape[1]
        if seg.mask is None and seg.length > 1:  # start == 0: a fresh causal chain
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=seg.mask, enable_gqa=gqa)

    def commit(self) -> None:
        """Advance each cache past its new tokens (after every layer has written them)."""
        for seg in self.segments:
            seg.cache.length = seg.start + seg.length


class StaticPlan:
    """A forward of at most `rows` new tokens over one paged storage, in buffers of fixed size:
    what a captured CUDA graph replays (`engine.graphs`), each step's plan written into the same
    tensors by `fill`. The rows' keys and values go to their slots (`new_slots`); rows past the
    plan are padding, which writes `scratch`, a slot no block owns.

    Attention reads the storage in one of two layouts, `by_rows` where the kernels' row attention
    takes the queries (see `Kernels.attends`), else the other:
    - by rows: each row's slots as CSR (`row_ptr`, `idx`: its prefix and its tree ancestors in
      position order, as `_KernelRows` lays them out), read by the row kernel, whose result for
      a row depends on that row's slots alone; `slots` bounds the slots of one row;
    - by columns: `slots` columns gathered from the storage (`gather`: every segment's prefix and
      new slots, one after the other) under a (rows, slots) mask in which each row sees its own
      segment's columns as its `Segment` says, for SDPA; padded rows see the scratch column."""

    def __init__(
        self,
        keys: torch.Tensor,  # (L, H_kv, S_all, D) the storage's key slots
        values: torch.Tensor,  # (L, H_kv, S_all, D)
        rows: int,
        slots: int,
        scratch: int,
        by_rows: bool,
    ) -> None:
        self.keys, self.values, self.rows, self.slots, self.scratch = keys, values, rows, slots, scratch
        self.by_rows = by_rows
        self.prefill_from = rows  # every row is a decoding step's
        device = keys.device
        self.new_slots = torch.full((rows,), scratch, dtype=torch.long, device=device)  # (T,)
        if by_rows:
            self.row_ids = torch.arange(rows, device=device)  # (T,) every row is computed
            self.row_ptr = torch.arange(rows + 1, device=device)  # (T+1,) one slot a row until filled
            self.idx = torch.full((rows * slots,), scratch, dtype=torch.long, device=device)  # (<= T*S,)
        else:
            self.gather = torch.full((slots,), scratch, dtype=torch.long, device=device)  # (S,)
            self.mask = torch.zeros(rows, slots, dtype=torch.bool, device=device)  # (T, S)
            self.mask[:, 0] = True

    def fill(self, segments: list[Segment]) -> None:
        """Write the plan of `segments` (their rows in order, `rows` at most in all; together at
        most `slots` slots, prefixes and new ones) into the buffers."""
        self.new_slots.fill_(self.scratch)
        if not self.by_rows:
            self.gather.fill_(self.scratch)
            self.mask.zero_()
        r = c = 0
        counts, lists = [], []
        for seg in segments:
            if self.by_rows:
                own, count, seen = seg.row_slots()
                counts.append(count)
                lists.append(seen)
            else:
                table, mask = seg.slots_seen()  # (start+T,), (T, start+T)
                own = table[seg.start :]
                self.gather[c : c + table.numel()] = table
                self.mask[r : r + seg.length, c : c + table.numel()] = mask
                c += table.numel()
            self.new_slots[r : r + seg.length] = own
            r += seg.length
        if not self.by_rows:
            self.mask[r:, 0] = True  # padded rows see one column, so their softmax stays finite
            return
        pad = self.rows - r  # each padded row sees the scratch slot alone
        counts.append(torch.ones(pad, dtype=torch.long, device=self.idx.device))
        lists.append(torch.full((pad,), self.scratch, dtype=torch.long, device=self.idx.device))
        idx = torch.cat(lists)
        self.idx[: idx.numel()] = idx
        torch.cumsum(torch.cat(counts), 0, out=self.row_ptr[1:])

    def kernel_rows(self, *args: object) -> None:
        """No one-call decoder: the layers run one by one (see `Transformer.forward_plan`)."""
        return None

    def attend(
        self,
        layer: int,
        q: torch.Tensor,  # (1, H, T, D), before rotary
        k: torch.Tensor,  # (1, H_kv, T, D), before rotary
        v: torch.Tensor,  # (1, H_kv, T, D)
        cos: torch.Tensor,  # (1, 1, T, D)
        sin: torch.Tensor,  # (1, 1, T, D)
        kernels: Kernels,
    ) -> torch.Tensor:
        """Store the rows' keys/values and attend: (1, H, T, D)."""
        keys, values = self.keys[layer], self.values[layer]  # (H_kv, S_all, D)
        if self.by_rows:
            assert kernels.attend_rows is not None
            b, h, t, d = q.shape
            out = torch.empty(b, t, h, d, dtype=q.dtype, device=q.device)  # (1, T, H, D)
            kernels.attend_rows(
                q[0], k[0], v[0], keys, values, self.row_ids, self.new_slots, self.row_ptr, self.idx,
                out[0], cos[0, 0], sin[0, 0],
            )  # fmt: skip
            return out.transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        keys.index_copy_(1, self.new_slots, k[0].to(keys.dtype))
        values.index_copy_(1, self.new_slots, v[0].to(values.dtype))
        seen_k = keys.index_select(1, self.gather)[None].to(q.dtype)  # (1, H_kv, S, D)
        seen_v = values.index_select(1, self.gather)[None].to(q.dtype)
        gqa = q.shape[1] != k.shape[1]
        return F.scaled_dot_product_attention(q, seen_k, seen_v, attn_mask=self.mask, enable_gqa=gqa)


@dataclass(frozen=True)
class _KernelRows:
    """The rows of a plan that the row-attention kernel computes, laid out once per forward: each
    row's own slot and, as CSR, the slots it attends to (its prefix and its tree ancestors)."""

    kernel: AttendRows
    cache: SequenceCache  # whose `layer_slots` every kernel row reads (one storage per plan)
    fast: list[bool]  # per segment: through the kernel
    rows: torch.Tensor  # (R,) long, indices into the forward's T tokens
    new_slots: torch.Tensor  # (R,) long
    row_ptr: torch.Tensor  # (R+1,) long
    idx: torch.Tensor  # (nnz,) long

    @classmethod
    def build(cls, segments: list[Segment], q: torch.Tensor, kernels: Kernels) -> _KernelRows | None:
        """None when no segment can use the kernel (none in `kernels`, queries it does not take:
        see `Kernels.attends`; only long segments)."""
        if not kernels.attends(q):
            return None
        assert kernels.attend_rows is not None
        first = segments[0].cache.layer_slots(0)
        if first is None:
            return None
        storage = first[0].data_ptr()  # the kernel reads one storage: the first segment's
        fast: list[bool] = []
        rows, new_slots, counts, idx = [], [], [], []
        at = 0
        for i, seg in enumerate(segments):
            slots = first if i == 0 else seg.cache.layer_slots(0)
            ok = (
                row_kernel_takes(seg)
                and (seg.mask is None or seg.mask.dim() == 2)
                and slots is not None
                and slots[0].data_ptr() == storage
            )
            fast.append(ok)
            if ok:
                own, count, seen = seg.row_slots()
                rows.append(torch.arange(at, at + seg.length, device=own.device))
                new_slots.append(own)
                counts.append(count)
                idx.append(seen)
            at += seg.length
        if not rows:
            return None
        row_ptr = torch.zeros(sum(r.numel() for r in rows) + 1, dtype=torch.long, device=first[0].device)
        torch.cumsum(_joined(counts), 0, out=row_ptr[1:])
        return cls(
            kernels.attend_rows,
            segments[fast.index(True)].cache,
            fast,
            _joined(rows),
            _joined(new_slots),
            row_ptr,
            _joined(idx),
        )


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """`torch.cat(parts)`, without the copy for one part (a request alone: most CPU steps)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)
