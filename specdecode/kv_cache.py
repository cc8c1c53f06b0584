"""Key/value cache with rollback and compaction as bookkeeping.

The cache is one preallocated tensor per kind (keys, values) for all layers. `length` counts the
valid slots; a forward writes its new tokens at slots `length .. length+T-1` and advances it.
Speculative decoding then either forgets rejected tokens (`rollback`, O(1): only `length` moves)
or keeps a tree's accepted path (`compact`: the chosen slots are moved into place, one gather).
"""

from __future__ import annotations

from typing import Protocol

import torch

from specdecode.errors import SpecDecodeError
from specdecode.models.config import ModelConfig


def moved(keep: torch.Tensor | list[int], device: torch.device) -> torch.Tensor | None:
    """`keep` (a compaction's offsets, increasing) as a tensor on `device`, or None where nothing
    moves (it is 0, 1, ..., M-1: a chain accepted from its root, the common case, checked on the
    host without a tensor op)."""
    if isinstance(keep, list):
        return None if keep == list(range(len(keep))) else torch.tensor(keep, dtype=torch.long, device=device)
    keep_t = keep.to(device=device, dtype=torch.long)  # (M,)
    return None if torch.equal(keep_t, torch.arange(keep_t.numel(), device=device)) else keep_t


class SequenceCache(Protocol):
    """What attention and the engine need from one sequence's cache: `KVCache` here, the serving
    engine's `PagedCache` (blocks shared by many requests) there."""

    length: int
    max_len: int

    @property
    def device(self) -> torch.device: ...

    def reserve(self, num_new: int) -> int: ...

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rollback(self, n: int) -> None: ...

    def truncate(self, length: int) -> None: ...

    def release(self) -> None:
        """Forget every token and give back what the cache holds in a shared pool, if anything."""
        ...

    def compact(self, start: int, keep: torch.Tensor | list[int]) -> None: ...

    # Prefix reuse across requests, where the cache's storage is shared (`PagedCache`); without a
    # shared pool nothing is reused and nothing offered.
    def reuse_prefix(self, token_ids: list[int]) -> int:
        """Start an empty cache on what the shared pool already holds for the longest run of full
        blocks that `token_ids` starts with; returns the tokens it reused."""
        ...

    def register_full_blocks(self, token_ids: list[int]) -> None:
        """Offer the full blocks holding the first tokens of `token_ids` (at most `length`) for
        later requests whose tokens start the same way."""
        ...

    # For attention kernels that read the cache in place: a layer's (H_kv, S, D) key and value
    # slots (None where there are none to read, e.g. a batch of sequences), and which slot holds
    # each position.
    def layer_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None: ...

    def slot_table(self, end: int) -> torch.Tensor: ...


class KVCache:
    """Static per-sequence cache: `k`, `v` are (L, B, H_kv, S_max, D); `length` slots are valid."""

    def __init__(
        self,
        config: ModelConfig,
        max_len: int,
        batch_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (config.num_layers, batch_size, config.num_kv_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0
        self._slots = torch.arange(max_len, device=device)
        # One sequence's (H_kv, S_max, D) keys and values of each layer, as views made once for
        # the tensors they view (training swaps in grown ones).
        self._layers: tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]] | None = None

    def layer_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer's keys and values as (H_kv, S_max, D) slots, which attention kernels read
        and write directly; None for a batch of several sequences."""
        if self.k.shape[1] != 1:
            return None
        if self._layers is None or self._layers[0] is not self.k or self._layers[1] is not self.v:
            views = list(zip(self.k[:, 0].unbind(0), self.v[:, 0].unbind(0), strict=True))
            self._layers = self.k, self.v, views
        return self._layers[2][layer]

    def slot_table(self, end: int) -> torch.Tensor:
        """(end,) long: the slot of each position 0..end-1 in `layer_slots` (here the identity)."""
        return self._slots[:end]

    @property
    def device(self) -> torch.device:
        return self.k.device

    def reserve(self, num_new: int) -> int:
        """Check that `num_new` more slots fit; returns the first new slot."""
        if self.length + num_new > self.max_len:
            raise SpecDecodeError(
                f"sequence of {self.length + num_new} tokens exceeds the cache size {self.max_len}"
            )
        return self.length

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new keys/values (B, H_kv, T, D) at `start` and return the layer's valid prefix
        (B, H_kv, start+T, D) for attention. `length` is advanced by the model, once per forward."""
        end = start + k.shape[2]
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def rollback(self, n: int) -> None:
        """Forget the newest `n` tokens."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot roll back {n} of {self.length} cached tokens")
        self.length -= n

    def truncate(self, length: int) -> None:
        """Keep only the first `length` tokens."""
        self.rollback(self.length - length)

    def release(self) -> None:
        """Forget every token (its tensors are its own: nothing to give back)."""
        self.length = 0

    def reuse_prefix(self, token_ids: list[int]) -> int:
        """Nothing to reuse: the tensors are this sequence's own."""
        return 0

    def register_full_blocks(self, token_ids: list[int]) -> None:
        """Nothing to offer: no other request reads this cache."""

    def compact(self, start: int, keep: torch.Tensor | list[int]) -> None:
        """Keep the slots `start + keep[i]` (a tree's accepted path, in order) at `start + i` and
        forget every slot after them. `keep` holds offsets relative to `start`, increasing."""
        m = len(keep)
        keep_t = moved(keep, self.k.device)  # (M,) or None
        if keep_t is not None:
            src = keep_t + start
            self.k[:, :, :, start : start + m] = self.k.index_select(3, src)
            self.v[:, :, :, start : start + m] = self.v.index_select(3, src)
        self.length = start + m
