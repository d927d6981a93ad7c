"""Which blocks a tier (the offload tier, the pooled store) keeps, finds and loads for a model with
several KV cache groups (core/kv_cache_groups.py: DeepSeek-V4's window, csa and hca groups).

Every full block of every group is stored as it is computed, under a key made from the one hashing
scheme: a group block is named by the chained hash of the engine block that ends its span (as
HybridKVCacheManager names it), mixed with the group's index for all but the first group, so the
groups never share a key. A window block holds per-token values, as exact as any other once its
tokens are computed, so it can be stored too, before the window leaves it behind.

A hit of T tokens (T a multiple of every group's block size, so no group's block is half known)
needs every compressed block before T and the window blocks the next token reads: the last
`sliding_window` tokens before T, exactly what HybridKVCacheManager allocates for a load. This
file never imports torch and never touches blocks; it returns (key, block id, group) orders.
"""
from __future__ import annotations

import math
from typing import Callable

from rackserve.core.hashing import group_block_hash
from rackserve.core.kv_cache_groups import KVCacheConfig
from rackserve.core.request import Request

Order = tuple[int, int, int]   # (key, block id, group)


class GroupBlocks:
    def __init__(self, kv_cache_config: KVCacheConfig, block_size: int):
        self.groups = kv_cache_config.groups
        self.block_size = block_size
        self.per_block = [g.block_size // block_size for g in self.groups]   # engine blocks per group block
        self.align = math.lcm(*(g.block_size for g in self.groups))

    def key(self, request: Request, group: int, index: int) -> int:
        block_hash = request.block_hashes[(index + 1) * self.per_block[group] - 1]
        return block_hash if group == 0 else group_block_hash(block_hash, group)

    def _window_span(self, num_tokens: int) -> range:
        window = self.groups[0]
        return range(max(0, num_tokens - window.sliding_window) // window.block_size,
                     -(-num_tokens // window.block_size))

    def hit_tokens(self, request: Request, start: int, held: Callable[[list[int]], list[bool]]) -> int:
        """Tokens after `start` (the local hit's first token to compute) that the tier can load:
        the largest aligned T whose blocks `held` says are all there, minus start; 0 if none."""
        top = (min(request.num_tokens - 1, len(request.block_hashes) * self.block_size) // self.align) * self.align
        if top <= start:
            return 0
        wanted: list[tuple[int, int]] = []   # (group, index)
        for g, group in enumerate(self.groups):
            first = self._window_span(start + 1).start if g == 0 else start // group.block_size
            wanted += [(g, i) for i in range(first, top // group.block_size)]
        found = dict(zip(wanted, held([self.key(request, g, i) for g, i in wanted])))
        # Compressed groups: every block from the local hit on, so T is bounded by the first missing one.
        for g, group in enumerate(self.groups[1:], start=1):
            i = start // group.block_size
            while found.get((g, i)):
                i += 1
            top = min(top, i * group.block_size // self.align * self.align)
        for t in range(top, start, -self.align):
            if all(found.get((0, i)) for i in self._window_span(t)):
                return t - start
        return 0

    def loads(self, request: Request, tables: tuple[list[int | None], ...], num_local: tuple[int, ...],
              num_tokens: int) -> list[Order]:
        """The allocated blocks after each group's local ones that hold KV of the first
        `num_tokens` tokens (a window table has None where nothing was allocated)."""
        out = []
        for g, (table, first, group) in enumerate(zip(tables, num_local, self.groups)):
            end = -(-num_tokens // group.block_size)
            out += [(self.key(request, g, i), table[i], g) for i in range(first, end) if table[i] is not None]
        return out

    def full_blocks(self, request: Request) -> list[int]:
        """Per group, how many leading blocks the request's computed tokens fill."""
        hashed = len(request.block_hashes) * self.block_size
        return [min(request.num_computed_tokens, hashed) // g.block_size for g in self.groups]

    def stores(self, request: Request, tables: tuple[list[int | None], ...], done: list[int]) -> list[Order]:
        """Blocks filled since `done` (per group; updated in place) that are still in the tables."""
        out = []
        for g, full in enumerate(self.full_blocks(request)):
            out += [(self.key(request, g, i), tables[g][i], g) for i in range(done[g], full)
                    if tables[g][i] is not None]
            done[g] = max(done[g], full)
        return out
