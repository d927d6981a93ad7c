"""HybridKVCacheManager: KVCacheManager's job for a model whose cache comes in several groups
(core/kv_cache_groups.py): one BlockPool and one block table per group per request.

The sliding group keeps only a request's last `sliding_window` tokens: blocks wholly behind them go
back to its pool as the request advances (its table keeps None there, sent to the workers as block
0, which they never read unmasked), so a long request holds O(window) of them. Compressed groups
are paged and prefix-cached like any cache; block j of a group whose blocks cover k engine blocks
is named by the chained hash of the engine block that ends its span (the one hashing scheme).

A prefix hit is the longest prefix every compressed group holds by hash; the sliding group is
rebuilt by a bounded replay (KVCacheConfig.replay_start): the request starts computing there, its
compressed tables keep the hit blocks, and the workers are told how many of each group's leading
blocks came from the cache, so the replay never writes into them.
Same surface as KVCacheManager, except that block ids come per group. Never imports torch.
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from rackserve.core.block_pool import BlockPool, KVBlock
from rackserve.core.hashing import extend_block_hashes
from rackserve.core.kv_cache_groups import KVCacheConfig
from rackserve.core.kv_cache_manager import NO_HIT, PrefixHit, cdiv
from rackserve.core.kv_events import AllBlocksCleared, KVCacheEvent
from rackserve.core.request import Request


class HybridHit(NamedTuple):
    blocks: tuple[list[KVBlock], ...]   # per compressed group (groups[1:])
    num_tokens: int                     # where computing starts: the replay's first token
    num_hit_tokens: int                 # the prefix found by hash (num_hit_tokens - num_tokens are replayed)


class HybridKVCacheManager:
    def __init__(self, kv_config: KVCacheConfig, block_size: int, enable_caching: bool = True, hash_seed: int = 0,
                 enable_kv_cache_events: bool = False):
        for g in kv_config.groups:
            assert g.block_size % block_size == 0, f"group {g.name}: blocks of {g.block_size} tokens"
        self.kv_config, self.groups = kv_config, kv_config.groups
        self.block_size, self.enable_caching, self.hash_seed = block_size, enable_caching, hash_seed
        # Each prefix-cached group's pool tells its own stores and evictions (the sliding group's
        # blocks are never found by hash, so it has none to tell).
        self.pools = [BlockPool(g.num_blocks, enable_caching and not g.sliding_window, enable_kv_cache_events)
                      for g in self.groups]
        self.req_to_blocks: dict[str, list[list[KVBlock | None]]] = {}
        self.num_cached_blocks: dict[str, list[int]] = {}   # per group: leading blocks registered
        self.num_hit_blocks: dict[str, tuple[int, ...]] = {}   # per group: blocks from the prefix cache

    @property
    def num_blocks(self) -> int:
        return sum(p.num_blocks for p in self.pools)

    def usage(self) -> float:
        """The fullest group's usage: the one that runs out first."""
        return max(p.usage() for p in self.pools)

    def _hashes(self, request: Request, group: int) -> list[int]:
        """Group `group`'s block hashes: those of the engine blocks that end its blocks."""
        main = extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                                   self.hash_seed, request.cache_salt)
        k = self.groups[group].block_size // self.block_size
        return main[k - 1::k]

    def get_computed_blocks(self, request: Request) -> HybridHit | PrefixHit:
        assert request.request_id not in self.req_to_blocks
        if not self.enable_caching or len(self.groups) == 1:
            return NO_HIT
        hit_tokens = request.num_tokens - 1     # the last token is always computed
        found: list[list[KVBlock]] = []
        for i, group in enumerate(self.groups[1:], start=1):
            blocks = []
            for block_hash in self._hashes(request, i)[:hit_tokens // group.block_size]:
                block = self.pools[i].get_cached_block(block_hash)
                if block is None:
                    break
                blocks.append(block)
            found.append(blocks)
            hit_tokens = min(hit_tokens, len(blocks) * group.block_size)
        hits = [blocks[:hit_tokens // g.block_size] for blocks, g in zip(found, self.groups[1:])]
        start = self.kv_config.replay_start(hit_tokens, [len(b) for b in hits], self.block_size)
        if start == 0:
            return NO_HIT
        return HybridHit(tuple(hits), start, hit_tokens)

    def allocate_slots(self, request: Request, num_new_tokens: int, hit: HybridHit | PrefixHit = NO_HIT,
                       delay_caching: bool = False) -> tuple[list[int], ...] | None:
        """KVCacheManager.allocate_slots per group: the ids appended to each group's table, or None,
        changing nothing, when a group has too few free blocks. The sliding group first gives back
        the blocks wholly behind its window.
        `delay_caching`: the new tokens' KV arrives from elsewhere (a KV connector): their blocks join
        the prefix cache at the next allocation, once it has landed, and the sliding group gets
        blocks only for the window the next token reads (a long prompt's whole span would not fit)."""
        rid = request.request_id
        new_request = rid not in self.req_to_blocks
        tables = self.req_to_blocks.get(rid) or [[] for _ in self.groups]
        hit_blocks = hit.blocks if isinstance(hit, HybridHit) else tuple([] for _ in self.groups[1:])
        computed = request.num_computed_tokens + hit.num_tokens
        end = computed + num_new_tokens
        window = self.groups[0]
        first_kept = max(0, (end if delay_caching else computed) - window.sliding_window) // window.block_size
        needs = []
        for i, (group, table) in enumerate(zip(self.groups, tables)):
            held = len(table) + (len(hit_blocks[i - 1]) if i else 0)
            if i == 0 and new_request:
                held = first_kept      # blocks before the window are never allocated
            needs.append(max(0, cdiv(end, group.block_size) - held))
        for i, (pool, need) in enumerate(zip(self.pools, needs)):
            touched = sum(1 for b in hit_blocks[i - 1] if b.ref_cnt == 0) if i else 0
            if need + touched > pool.num_free_blocks:
                return None
        # Behind the window: back to the pool (uncached blocks go to the front of its queue).
        behind = [b for b in tables[0][:first_kept] if b is not None]
        tables[0][:first_kept] = [None] * min(first_kept, len(tables[0]))
        self.pools[0].free_blocks(reversed(behind))
        if new_request:
            tables[0].extend([None] * first_kept)
            self.req_to_blocks[rid] = tables
            self.num_hit_blocks[rid] = (0, *(len(b) for b in hit_blocks))
            self.num_cached_blocks[rid] = [0, *(len(b) for b in hit_blocks)]
        new_ids = []
        for i, (pool, need) in enumerate(zip(self.pools, needs)):
            hits = hit_blocks[i - 1] if i else []
            pool.touch(hits)    # first: a free hit block must leave the queue before any is popped
            new = hits + pool.get_new_blocks(need)
            tables[i].extend(new)
            new_ids.append([b.block_id for b in new])
        if not delay_caching:
            self._cache_full_blocks(request, end)
        return tuple(new_ids)

    def _cache_full_blocks(self, request: Request, end: int) -> None:
        """Register the compressed groups' blocks that `end` tokens fill."""
        if not self.enable_caching:
            return
        cached = self.num_cached_blocks[request.request_id]
        for i, group in enumerate(self.groups[1:], start=1):
            num_full = end // group.block_size
            if num_full > cached[i]:
                pool, table, hashes = self.pools[i], self.req_to_blocks[request.request_id][i], self._hashes(request, i)
                for block, block_hash in zip(table[cached[i]:num_full], hashes[cached[i]:num_full]):
                    twin = pool.get_cached_block(block_hash)
                    if twin is not None and twin.ref_cnt == 0:
                        # A free copy computed earlier: this one takes the name, so that the prefix a
                        # hit needs whole is not lost to the LRU piece by piece (old twins go first).
                        pool.uncache(twin)
                pool.cache_blocks(table, hashes, cached[i], num_full, request.all_token_ids, group.block_size)
                cached[i] = num_full

    def free(self, request: Request) -> None:
        tables = self.req_to_blocks.pop(request.request_id, None) or []
        self.num_cached_blocks.pop(request.request_id, None)
        self.num_hit_blocks.pop(request.request_id, None)
        for pool, table in zip(self.pools, tables):
            pool.free_blocks(b for b in reversed(table) if b is not None)

    def take_events(self) -> list[KVCacheEvent]:
        """Each group's events, tagged with the group's index (vLLM's group_idx): a group's block
        of k engine blocks is named by the hash of the engine block that ends it, so a consumer
        holding the engine-block hashes of a prompt finds the group's blocks at every k-th."""
        events: list[KVCacheEvent] = []
        for i, pool in enumerate(self.pools):
            events += [e if isinstance(e, AllBlocksCleared) else replace(e, group_idx=i) for e in pool.take_events()]
        return events

    def block_ids(self, request: Request) -> tuple[list[int], ...]:
        """Each group's table; block 0 where the sliding group gave its block back."""
        tables = self.req_to_blocks.get(request.request_id) or [[] for _ in self.groups]
        return tuple([0 if b is None else b.block_id for b in table] for table in tables)

    def transfer_block_ids(self, request: Request) -> tuple[list[int | None], ...]:
        """Each group's table for a KV connector: None where the sliding group holds no block."""
        tables = self.req_to_blocks.get(request.request_id) or [[] for _ in self.groups]
        return tuple([None if b is None else b.block_id for b in table] for table in tables)

    def hit_blocks(self, request: Request) -> tuple[int, ...]:
        """Per group, the leading blocks that came from the prefix cache (the workers must not
        write them)."""
        return self.num_hit_blocks.get(request.request_id, ())

    def num_held_blocks(self, request: Request, group: int) -> int:
        return sum(1 for b in self.req_to_blocks.get(request.request_id, [[]] * len(self.groups))[group]
                   if b is not None)

    def check_integrity(self) -> None:
        for i, pool in enumerate(self.pools):
            pool.check_integrity()
            refs: dict[int, int] = {}
            for tables in self.req_to_blocks.values():
                for b in tables[i]:
                    if b is not None:
                        refs[b.block_id] = refs.get(b.block_id, 0) + 1
            for block in pool.blocks:
                assert block.ref_cnt == refs.get(block.block_id, 0), (self.groups[i].name, block)
