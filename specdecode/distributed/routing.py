"""Prefix-aware choice of a replica, kept free of Ray so that it is easy to test and to read.

Each replica's engine reuses the KV blocks of prompt prefixes it has seen (`BlockPool`), but only
its own. `PrefixTable` remembers, per replica, the chained hashes of the full prompt blocks it
was sent (most recent first out when a replica's table is full), and `choose` sends a request to
the replica that was sent the longest run of its leading blocks, when that run is at least half
of the prompt's blocks: the next turn of a conversation (whose prompt starts with the previous
turn's), a long shared document. A short shared prefix (a chat template's system prompt, which
every request of a model starts with) is not worth a queue: otherwise, and when the replica
holding the prefix is busier than the least busy by more than `imbalance` requests, the least
busy replica gets the request, so reuse never piles load on one replica.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Hashable, Sequence


def block_hashes(prompt_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of `prompt_ids` but its last token (the tokens an engine
    caches before its first step): hash i covers tokens 0 .. (i+1)*block_size - 1."""
    out, last = [], 0
    for start in range(0, len(prompt_ids) - 1 - block_size + 1, block_size):
        last = hash((last, tuple(prompt_ids[start : start + block_size])))
        out.append(last)
    return out


class PrefixTable:
    """The block hashes sent to each replica, at most `capacity` per replica (least recent out)."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._sent: dict[Hashable, OrderedDict[int, None]] = {}

    def matched(self, replica: Hashable, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` that `replica` was sent."""
        sent = self._sent.get(replica)
        if not sent:
            return 0
        n = 0
        while n < len(hashes) and hashes[n] in sent:
            n += 1
        return n

    def record(self, replica: Hashable, hashes: Sequence[int]) -> None:
        sent = self._sent.setdefault(replica, OrderedDict())
        for h in hashes:
            sent[h] = None
            sent.move_to_end(h)
        while len(sent) > self.capacity:
            sent.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        """The replica died: its cache went with it."""
        self._sent.pop(replica, None)


def choose(
    table: PrefixTable,
    replicas: Sequence[Hashable],
    load: Sequence[int | None],
    hashes: Sequence[int],
    imbalance: int,
) -> list[list[int]]:
    """Ranks of indices into `replicas`, most preferred first: the replica holding the longest
    prefix (when it covers half of `hashes` or more and the replica is not too busy), then the
    rest by load (`load[i]`: its queue length, None when unknown, taken as idle)."""
    loads = [0 if n is None else n for n in load]
    shuffled = random.sample(range(len(replicas)), len(replicas))  # equal loads: a random order
    by_load = sorted(shuffled, key=lambda i: loads[i])
    if not by_load:
        return []
    matched = [table.matched(r, hashes) for r in replicas]
    best = max(range(len(replicas)), key=lambda i: (matched[i], -loads[i]))
    worth_it = matched[best] > 0 and 2 * matched[best] >= len(hashes)
    if worth_it and loads[best] - loads[by_load[0]] <= imbalance:
        return [[best], [i for i in by_load if i != best]]
    return [by_load[:2], by_load[2:]] if len(by_load) > 2 else [by_load]
