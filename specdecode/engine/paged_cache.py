"""The target's KV cache as fixed-size blocks shared by every request, and the per-sequence view
the model's attention writes to and reads from.

`PagedKVStorage` holds keys and values for all layers as (L, H_kv, num_blocks * block_size, D)
tensors: slot `block * block_size + i` is token i of that block. `PagedCache` is one sequence's
block table over it, with the same interface as the static `KVCache` (`length`, `reserve`,
`write`, `rollback`, `truncate`, `compact`), so `AttentionPlan` and the engine's `StepPlan` use
either unchanged.

The target's storage also keeps each slot's hidden state (the model's output row, (S_all, C)),
moved with the keys and values: a request served from reused blocks finds the rows of its cached
prompt there, which feature-reading drafters (EAGLE, Medusa, ReDrafter) and training's
`return_hidden` need. It costs C values a token beside 2 * L * H_kv * D of keys and values
(SmolLM2: 5%).

Attention reads a sequence's prefix by gathering its slots, one `index_select` per layer: simple,
and on a CPU cheap next to the weights a forward reads (SmolLM2: 23 KB per token per layer pair,
against 540 MB of weights).
"""

from __future__ import annotations

import torch

from specdecode.engine.block_pool import NO_PARENT, BlockPool
from specdecode.errors import SpecDecodeError
from specdecode.kv_cache import moved
from specdecode.models.config import ModelConfig


class PagedKVStorage:
    """Keys/values of every block for all layers, and the pool that hands the blocks out."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        hidden: bool = True,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """Keys and values are kept in `kv_dtype` (`dtype`, the model's, where None), the hidden
        states in `dtype`."""
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        slots = num_blocks * block_size
        # One slot past the blocks belongs to none: the padded rows of a captured forward write
        # there (`attention.StaticPlan`). Zeroed, as nothing else is: attention only reads slots a
        # forward wrote first, and on a CPU a large empty tensor is mapped lazily, so memory is
        # taken as blocks are used, not all at start.
        self.scratch = slots
        shape = (config.num_layers, config.num_kv_heads, slots + 1, config.head_dim)
        self.k = torch.empty(shape, dtype=kv_dtype or dtype, device=device)
        self.v = torch.empty(shape, dtype=kv_dtype or dtype, device=device)
        self.k[:, :, slots].zero_()
        self.v[:, :, slots].zero_()
        # Each layer's (H_kv, S_all, D) keys and values as views made once: a one-call forward
        # asks for every layer's every step (indexing made 2 new tensors a layer, ~30 µs a step).
        self.layers = list(zip(self.k.unbind(0), self.v.unbind(0), strict=True))
        # (S_all, C) each slot's hidden state; None for a draft model's storage (nobody reads it)
        self.h = torch.empty(slots, config.hidden_size, dtype=dtype, device=device) if hidden else None

    @staticmethod
    def block_bytes(
        config: ModelConfig,
        block_size: int,
        dtype: torch.dtype,
        hidden: bool = True,
        kv_dtype: torch.dtype | None = None,
    ) -> int:
        """Bytes one block takes: keys and values of `block_size` tokens in every layer (in
        `kv_dtype`, else `dtype`), and their hidden states (in `dtype`) when kept."""
        kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * (kv_dtype or dtype).itemsize
        return (kv + (config.hidden_size * dtype.itemsize if hidden else 0)) * block_size

    @property
    def device(self) -> torch.device:
        return self.k.device


class PagedCache:
    """One sequence's KV cache as a block table over `storage`, up to `max_len` tokens.

    `length` slots are valid (the tokens the model has committed). `reserve` allocates blocks for
    new tokens; `rollback`/`truncate`/`compact` move `length` and free the blocks past it.
    `register_full_blocks` enters the sequence's full blocks into the prefix cache, and
    `reuse_prefix` starts an empty one on registered blocks; neither acts without `prefix_caching`.
    """

    def __init__(self, storage: PagedKVStorage, max_len: int, prefix_caching: bool = True) -> None:
        self.storage = storage
        self.prefix_caching = prefix_caching
        self.pool = storage.pool
        self.block_size = storage.block_size
        self.max_len = max_len
        self.blocks: list[int] = []
        self.length = 0
        self._slots = torch.zeros(0, dtype=torch.long, device=storage.device)  # (S,) slot of each token
        self._registered = 0  # leading blocks already entered into the prefix cache
        self._last_hash = NO_PARENT  # chained hash of those blocks

    @property
    def device(self) -> torch.device:
        return self.storage.device

    # ---- block accounting ----------------------------------------------------------------------

    def blocks_needed(self, num_new: int) -> int:
        """Fresh blocks `reserve(num_new)` would take (including a private copy of a shared block
        that the new tokens would write into)."""
        bs = self.block_size
        need = max(0, -(-(self.length + num_new) // bs) - len(self.blocks))
        first = self.length // bs
        if num_new and first < len(self.blocks) and self.pool.is_shared(self.blocks[first]):
            need += 1
        return need

    def adopt(self, blocks: list[int], parent_hash: int) -> None:
        """Start an empty sequence on reused prefix blocks (already referenced via `pool.take`)."""
        assert not self.blocks and self.length == 0
        self.blocks = list(blocks)
        self.length = len(blocks) * self.block_size
        self._registered = len(blocks)
        self._last_hash = parent_hash
        self._refresh_slots()

    def release(self) -> None:
        """Free every block (the sequence is finished, aborted or preempted)."""
        for block in self.blocks:
            self.pool.free(block)
        self.blocks = []
        self.length = 0
        self._registered, self._last_hash = 0, NO_PARENT
        self._refresh_slots()

    def reuse_prefix(self, token_ids: list[int]) -> int:
        """Start this empty sequence on the registered blocks holding the longest run of full
        blocks that `token_ids` starts with (a draft model's cache: the target's go through the
        scheduler, which also counts them against its budget); returns the tokens reused."""
        if not self.prefix_caching:
            return 0
        blocks, last_hash = self.pool.match_prefix(token_ids)
        self.pool.take(blocks)
        self.adopt(blocks, last_hash)
        return self.length

    def register_full_blocks(self, token_ids: list[int]) -> None:
        """Enter the blocks that the first tokens of `token_ids` (the sequence's, up to `length`)
        fill completely into the prefix cache."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        end = min(self.length, len(token_ids))
        while (self._registered + 1) * bs <= end:
            i = self._registered
            self._last_hash = self.pool.register(
                self.blocks[i], self._last_hash, token_ids[i * bs : (i + 1) * bs]
            )
            self._registered += 1

    # ---- the KVCache interface -----------------------------------------------------------------

    def reserve(self, num_new: int) -> int:
        """Make room for `num_new` slots after `length` (blocks from the pool); returns the first.

        The caller (the scheduler) checks `blocks_needed` against the pool first. A shared block
        that the new tokens would write into is replaced by a private copy first: a reused or
        registered block is never written."""
        if self.length + num_new > self.max_len:
            raise SpecDecodeError(
                f"sequence of {self.length + num_new} tokens exceeds the cache size {self.max_len}"
            )
        bs = self.block_size
        first = self.length // bs
        changed = False
        if num_new and first < len(self.blocks) and self.pool.is_shared(self.blocks[first]):
            self._copy_on_write(first)
            changed = True
        while len(self.blocks) * bs < self.length + num_new:
            self.blocks.append(self.pool.allocate())
            changed = True
        if changed:
            self._refresh_slots()
        return self.length

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new keys/values (1, H_kv, T, D) at `start` and return the layer's valid prefix
        (1, H_kv, start+T, D) for attention, gathered from the blocks in `k`'s dtype (a cache
        kept narrower rounds what it stores, and every read sees the rounded values)."""
        end = start + k.shape[2]
        slots = self._slots[:end]  # (start+T,)
        keys, values = self.storage.layers[layer]  # (H_kv, S_all, D)
        keys[:, slots[start:]] = k[0].to(keys.dtype)
        values[:, slots[start:]] = v[0].to(values.dtype)
        return keys.index_select(1, slots)[None].to(k.dtype), values.index_select(1, slots)[None].to(v.dtype)

    def write_hidden(self, start: int, rows: torch.Tensor) -> None:
        """Store the hidden states (T, C) of positions `start .. start+T-1` (reserved slots)."""
        assert self.storage.h is not None, "this storage keeps no hidden states"
        self.storage.h[self._slots[start : start + rows.shape[0]]] = rows

    def hidden(self, end: int) -> torch.Tensor:
        """(end, C): the hidden states of positions 0 .. end-1, as written (a copy)."""
        assert self.storage.h is not None, "this storage keeps no hidden states"
        return self.storage.h[self._slots[:end]]

    def layer_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values of every block as (H_kv, S_all, D) slots."""
        return self.storage.layers[layer]

    def slot_table(self, end: int) -> torch.Tensor:
        """(end,) long: the slot of each position 0..end-1 (reserved ones included)."""
        return self._slots[:end]

    def rollback(self, n: int) -> None:
        """Forget the newest `n` tokens and free the blocks no longer needed."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot roll back {n} of {self.length} cached tokens")
        self.length -= n
        self._free_tail()

    def truncate(self, length: int) -> None:
        """Keep only the first `length` tokens."""
        self.rollback(self.length - length)

    def compact(self, start: int, keep: torch.Tensor | list[int]) -> None:
        """Keep the slots `start + keep[i]` (a tree's accepted path, in order) at `start + i` and
        forget every slot after them, as `KVCache.compact`."""
        m = len(keep)
        keep_t = moved(keep, self.device)  # (M,) or None
        if keep_t is not None:
            src = self._slots[start + keep_t]  # (M,)
            dst = self._slots[start : start + m]  # (M,)
            for store in (self.storage.k, self.storage.v):
                store[:, :, dst] = store[:, :, src]
            if self.storage.h is not None:
                self.storage.h[dst] = self.storage.h[src]
        self.length = start + m
        self._free_tail()

    # ---- helpers -------------------------------------------------------------------------------

    def _free_tail(self) -> None:
        """Free the blocks wholly past `length` (a rollback into a registered block is refused:
        its tokens are what the prefix cache promises)."""
        bs = self.block_size
        keep = -(-self.length // bs)
        if self.length < self._registered * bs:
            raise ValueError("cannot roll back into a block registered in the prefix cache")
        if keep < len(self.blocks):
            for block in self.blocks[keep:]:
                self.pool.free(block)
            del self.blocks[keep:]
            self._refresh_slots()

    def _copy_on_write(self, i: int) -> None:
        """Replace block i by a private copy (same contents) before it is written."""
        old, new = self.blocks[i], self.pool.allocate()
        bs = self.block_size
        src = slice(old * bs, (old + 1) * bs)
        dst = slice(new * bs, (new + 1) * bs)
        self.storage.k[:, :, dst] = self.storage.k[:, :, src]
        self.storage.v[:, :, dst] = self.storage.v[:, :, src]
        if self.storage.h is not None:
            self.storage.h[dst] = self.storage.h[src]
        self.pool.free(old)
        self.blocks[i] = new

    def _refresh_slots(self) -> None:
        """Recompute the slot of every token position the block table covers."""
        bs = self.block_size
        table = torch.tensor(self.blocks, dtype=torch.long, device=self.device)  # (nb,)
        offsets = torch.arange(bs, device=self.device)  # (bs,)
        self._slots = (table[:, None] * bs + offsets).reshape(-1)  # (nb*bs,)
