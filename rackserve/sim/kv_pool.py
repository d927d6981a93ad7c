"""A simulated KV pool (Mooncake-like: DRAM and spare HBM behind RDMA) shared by every instance:
an LRU set of block hashes (core/hashing.py's, so a hit means what it means in the prefix cache)
of a given capacity, and the bandwidth its blocks load at.

The pool does not drive the engine's store connector (kv_transfer/) yet, as P/D drives its
MooncakeConnector (sim/transfer.py), so it acts on pricing only: a prompt's tokens beyond its
instance's own prefix hit that the pool holds are still scheduled (they take token budget) but are
priced as a load at pool bandwidth instead of a prefill. Every block a step computes is offered to
the pool. This file owns the pool's index; it must never schedule.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from rackserve.core.hashing import block_hashes


class KVPool:
    def __init__(self, capacity_tokens: int, bandwidth: float, block_size: int, hash_seed: int = 0):
        assert capacity_tokens > 0 and bandwidth > 0
        self.capacity_blocks = max(1, capacity_tokens // block_size)
        self.bandwidth = bandwidth              # bytes/s one instance loads at
        self.block_size, self.hash_seed = block_size, hash_seed
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.hit_tokens = 0                     # tokens priced as loads, for the record

    def hashes(self, token_ids: Sequence[int]) -> list[int]:
        return block_hashes(token_ids, self.block_size, self.hash_seed)

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
