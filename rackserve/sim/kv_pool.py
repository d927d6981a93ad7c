"""A simulated KV pool (Mooncake-like: DRAM and spare HBM behind RDMA) shared by every instance:
an LRU set of block hashes (core/hashing.py's, as the prefix cache and the store connector key
blocks, so a hit means what it means there) of a given capacity, and the bandwidth its blocks load
at. The engine's store connector drives it (sim/kv_store.py: its lookups, loads and stores).
This file owns the pool's index; it must never schedule nor price.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class KVPool:
    def __init__(self, capacity_tokens: int, bandwidth: float, block_size: int):
        assert capacity_tokens > 0 and bandwidth > 0
        self.capacity_blocks = max(1, capacity_tokens // block_size)
        self.bandwidth = bandwidth              # bytes/s one instance loads at
        self.block_size = block_size
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.hit_tokens = 0                     # tokens priced as loads, for the record

    def prefix_tokens(self, hashes: Sequence[int], limit: int) -> int:
        """Tokens of the longest prefix the pool holds, at most `limit`; touches what it finds."""
        found = 0
        for h in hashes[:limit // self.block_size]:
            if h not in self.blocks:
                break
            self.blocks.move_to_end(h)
            found += self.block_size
        return found

    def offer(self, hashes: Sequence[int]) -> None:
        """Blocks now computed somewhere: the pool keeps the most recent, evicting the oldest."""
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity_blocks:
            self.blocks.popitem(last=False)
