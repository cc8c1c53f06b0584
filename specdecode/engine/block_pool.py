"""Which KV blocks are in use, by whom, and which freed ones still hold a reusable prefix.

The target's KV cache is cut into fixed-size *blocks* of `block_size` token slots; a sequence's
*block table* lists the blocks holding its tokens in order. This module is the bookkeeping only
(no tensors): reference counts, the free list, and the prefix cache.

Prefix cache: once a block is full, it is registered under a hash chained over the whole token
prefix it ends (`block_hash(parent_hash, tokens)`), so a block matches only when every token
before it matches too. A new sequence walks its prompt block by block and takes (adds a
reference to) each registered block that matches; the first miss ends the walk. A registered block
whose last reference goes away stays registered on the free list: it is reused if a later
prompt matches, and overwritten (its registration dropped) only when a fresh block is needed and
it is the least recently freed. Blocks that were never registered are handed out first.

A registered block is never written again: only full blocks are registered and a sequence only
writes at or after its own length (see `PagedCache.reserve`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from specdecode.errors import OutOfKVBlocks, SpecDecodeError

NO_PARENT = 0  # the chained hash of the empty prefix


def block_hash(parent_hash: int, tokens: Sequence[int]) -> int:
    """Hash of a full block given the hash of everything before it."""
    return hash((parent_hash, tuple(tokens)))


class BlockPool:
    """`num_blocks` blocks with reference counts, an LRU free list and the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise SpecDecodeError(f"the KV cache must hold at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refcount = [0] * num_blocks
        # Free blocks in the order they should be handed out: unregistered first, then registered
        # ones least recently freed first.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._hash_of: dict[int, int] = {}  # registered block -> its chained hash
        self._tokens_of: dict[int, tuple[int, ...]] = {}  # registered block -> its tokens
        self._block_of: dict[int, int] = {}  # chained hash -> registered block
        self.num_reused = 0  # blocks taken from the prefix cache, cumulative

    # ---- counts --------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks that `allocate` can hand out (free, whether or not they hold a cached prefix)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Registered blocks (in use or free) that a matching prefix could reuse."""
        return len(self._hash_of)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    # ---- allocation ----------------------------------------------------------------------------

    def allocate(self) -> int:
        """A block for new writes, evicting the least recently freed cached prefix if need be."""
        if not self._free:
            raise OutOfKVBlocks("out of KV cache blocks")  # the scheduler checks can_allocate first
        block, _ = self._free.popitem(last=False)
        self._unregister(block)
        self.refcount[block] = 1
        return block

    def free(self, block: int) -> None:
        """Drop one reference; at zero the block joins the free list (kept cached if registered)."""
        assert self.refcount[block] > 0, f"block {block} freed twice"
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self._free[block] = None
            if block not in self._hash_of:
                self._free.move_to_end(block, last=False)  # holds nothing reusable: hand out first

    def is_shared(self, block: int) -> bool:
        """Whether writing to `block` could change what another sequence or the prefix cache reads."""
        return self.refcount[block] > 1 or block in self._hash_of

    # ---- prefix cache --------------------------------------------------------------------------

    def register(self, block: int, parent_hash: int, tokens: Sequence[int]) -> int:
        """Record that full `block` holds `tokens` after the prefix hashed `parent_hash`; returns
        its own chained hash. If another block already holds this prefix, that one stays the
        cached copy and `block` remains private."""
        h = block_hash(parent_hash, tokens)
        if h not in self._block_of and block not in self._hash_of:
            self._block_of[h] = block
            self._hash_of[block] = h
            self._tokens_of[block] = tuple(tokens)
        return h

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """The registered blocks holding the longest run of full blocks that starts `token_ids`
        (not yet referenced: pass them to `take`), and the chained hash of that run. A hash hit is
        confirmed on the block's tokens, so only a collision of the whole chain with the same
        last block could mislead it."""
        bs = self.block_size
        blocks: list[int] = []
        h = NO_PARENT
        for i in range(len(token_ids) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            nxt = block_hash(h, tokens)
            block = self._block_of.get(nxt)
            if block is None or self._tokens_of[block] != tokens:
                break
            blocks.append(block)
            h = nxt
        return blocks, h

    def num_free_among(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` are on the free list (taking them uses up free blocks)."""
        return sum(self.refcount[b] == 0 for b in blocks)

    def take(self, blocks: Sequence[int]) -> None:
        """Add a reference to each of `blocks` (a `match_prefix` result), counting them as reused."""
        for block in blocks:
            if self.refcount[block] == 0:
                del self._free[block]
            self.refcount[block] += 1
        self.num_reused += len(blocks)

    def clear_prefix_cache(self) -> None:
        """Forget every free block's cached prefix (blocks in use keep theirs)."""
        for block in list(self._free):
            self._unregister(block)
        self._free = OrderedDict(sorted(self._free.items()))

    def _unregister(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._block_of[h]
            del self._tokens_of[block]
