"""KVCacheManager: gives requests KV blocks, finds their cached prefixes, takes blocks back.

The scheduler talks to it in token counts and gets block ids back; it never touches the pool's
internals. Full blocks are registered in the prefix cache as soon as they are allocated for tokens
scheduled this step: the model writes every new token's KV in a layer before any attention in
that layer reads it, so a request scheduled later in the same step may already hit them.
This file never imports torch.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from rackserve.core.block_pool import BlockPool, KVBlock
from rackserve.core.hashing import extend_block_hashes
from rackserve.core.kv_events import KVCacheEvent
from rackserve.core.request import Request


class PrefixHit(NamedTuple):
    blocks: list[KVBlock]
    num_tokens: int


NO_HIT = PrefixHit([], 0)


class BlockIdView(Sequence):
    """A request's block ids read through its block table, without building the list: what a
    connector is told every step (a table of hundreds of blocks a long request), where a list per
    scheduled request and step cost more than the rest of the step. The table only grows while
    the request holds it, so an index read later gives the id it had when the view was made."""
    __slots__ = ("_blocks",)

    def __init__(self, blocks: list[KVBlock]):
        self._blocks = blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [b.block_id for b in self._blocks[i]]
        return self._blocks[i].block_id

    def __eq__(self, other) -> bool:
        return list(self) == (list(other) if isinstance(other, BlockIdView) else other)

    def __repr__(self) -> str:
        return f"BlockIdView({list(self)!r})"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, hash_seed: int = 0,
                 enable_kv_cache_events: bool = False):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_seed = hash_seed
        self.pool = BlockPool(num_blocks, enable_caching, enable_kv_cache_events)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}   # how many leading blocks are registered

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def _update_hashes(self, request: Request) -> list[int]:
        return extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                                   self.hash_seed, request.cache_salt)

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """The longest cached prefix of a request that holds no blocks yet, in whole blocks.

        The last token is always recomputed, so the model has a position to sample from.
        """
        assert request.request_id not in self.req_to_blocks
        if not self.enable_caching:
            return NO_HIT
        hashes = self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[KVBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hit.append(block)
        return PrefixHit(hit, len(hit) * self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int, hit: PrefixHit = NO_HIT,
                       delay_caching: bool = False) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the request's computed ones (and after
        `hit`, a prefix found by get_computed_blocks for a request being admitted).
        `delay_caching`: the new tokens' KV arrives from elsewhere, so their blocks join the prefix
        cache only at the request's next allocation, once the KV has landed.

        Returns the ids of the blocks appended to the request's block table (the hit's first),
        or None, changing nothing, when too few blocks are free.
        """
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + hit.num_tokens
        num_needed = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(hit.blocks)
        num_needed = max(num_needed, 0)
        # Hit blocks sitting in the free queue leave it when touched: they cost free blocks too.
        num_free_hits = sum(1 for b in hit.blocks if b.ref_cnt == 0)
        if num_needed + num_free_hits > self.pool.num_free_blocks:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.pool.touch(hit.blocks)
        new_blocks = hit.blocks + self.pool.get_new_blocks(num_needed)
        blocks.extend(new_blocks)
        if self.enable_caching:
            # Never past the request's own tokens: draft tokens (speculative decoding) may be rejected.
            num_full = min(num_computed + num_new_tokens, request.num_tokens) // self.block_size
            # At admission the hit blocks are the registered ones.
            num_cached = self.num_cached_blocks.get(request.request_id, len(hit.blocks))
            if num_full > num_cached and not delay_caching:
                self.pool.cache_blocks(blocks, self._update_hashes(request), num_cached, num_full,
                                      request.all_token_ids, self.block_size)
            self.num_cached_blocks[request.request_id] = num_cached if delay_caching else max(num_full, num_cached)
        return [b.block_id for b in new_blocks]

    def free(self, request: Request) -> None:
        """Release all of a request's blocks; its full blocks stay findable until evicted."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def take_events(self) -> list[KVCacheEvent]:
        """KV events (core/kv_events.py) since the last call; always empty unless enabled."""
        return self.pool.take_events()

    def block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request.request_id, [])]

    def block_id_view(self, request: Request) -> BlockIdView:
        """block_ids as a view: no list built (what the scheduler tells a connector each step)."""
        return BlockIdView(self.req_to_blocks.get(request.request_id, []))

    def check_integrity(self) -> None:
        """Pool invariants, plus: ref counts equal the number of requests holding each block."""
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), block
