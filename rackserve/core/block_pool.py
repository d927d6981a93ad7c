"""BlockPool: owns every KV block's bookkeeping (reference counts, hashes, the free queue).

A block is in use (ref_cnt > 0) or free. Free blocks wait in an LRU queue; those that still hold a
hash stay findable by it (the prefix cache) until they are evicted, oldest first, to make room.
With events enabled, every store, eviction and reset queues exactly one KV event (core/kv_events.py)
for the engine to publish; a block whose hash already has a cached twin stores nothing.
Blocks are made on first use (core/free_block_queue.py), so a pool of millions starts at once.
This file never decides which request gets blocks (that is KVCacheManager) and never imports torch.
"""
from __future__ import annotations

from collections.abc import Iterable

from rackserve.core.free_block_queue import BlockList, FreeBlockQueue, KVBlock
from rackserve.core.hashing import BlockHash
from rackserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, enable_kv_cache_events: bool = False):
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_event_queue: list[KVCacheEvent] = []
        self.blocks = BlockList(num_blocks)
        # Free blocks, least recently freed first: the front is evicted first; O(1) removal from
        # the middle when a cached free block is hit again.
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        """Fraction of blocks in use by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks found in the cache, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Pop n blocks from the front of the free queue, evicting their cached contents."""
        assert n <= self.num_free_blocks, f"asked for {n} blocks, {self.num_free_blocks} free"
        out: list[KVBlock] = []
        queue = self.free_queue
        while len(out) < n:
            fresh = queue.popleft_fresh(n - len(out))   # never used: nothing to evict
            if fresh:
                for block in fresh:
                    block.ref_cnt = 1
                out += fresh
                continue
            block = queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def cache_blocks(self, blocks: list[KVBlock], hashes: list[BlockHash], start: int, end: int,
                     token_ids: list[int], block_size: int) -> None:
        """Register blocks[start:end] (now full, holding token_ids[start * block_size:]) under
        hashes[start:end]; one BlockStored event per run of consecutive newly stored blocks."""
        if not self.enable_caching:
            return
        run: list[int] = []     # indices into blocks of the run being stored
        for i in range(start, end):
            block, block_hash = blocks[i], hashes[i]
            assert block.block_hash is None or block.block_hash == block_hash
            if block.block_hash is None and block_hash in self.cached:
                # Computed twice by concurrent requests: the first copy stays the findable one, and
                # this block holds no hash it does not own (it is reused first once freed).
                self._store_event(run, hashes, token_ids, block_size)
                run = []
                continue
            if block.block_hash is None:
                block.block_hash = block_hash
                self.cached[block_hash] = block
                run.append(i)
        self._store_event(run, hashes, token_ids, block_size)

    def _store_event(self, run: list[int], hashes: list[BlockHash], token_ids: list[int],
                     block_size: int) -> None:
        if not run or not self.enable_kv_cache_events:
            return
        first, last = run[0], run[-1] + 1
        self.kv_event_queue.append(BlockStored(
            block_hashes=hashes[first:last], parent_block_hash=hashes[first - 1] if first else None,
            token_ids=list(token_ids[first * block_size:last * block_size]), block_size=block_size))

    def take_events(self) -> list[KVCacheEvent]:
        """The events queued since the last call, oldest first."""
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block; blocks reaching zero join the back of the free queue,
        so pass a request's blocks tail first: its prefix then outlives its tail in the cache."""
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed twice"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    # Nothing to find in it: reuse it before any cached block.
                    self.free_queue.push_front(block)
                else:
                    self.free_queue.push_back(block)

    def uncache(self, block: KVBlock) -> None:
        """Forget a free block's hash, so that a fresher copy of its content can take the name."""
        assert block.ref_cnt == 0, block
        self._evict(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks.made:      # blocks never made hold no hash
            block.block_hash = None
        self.cached.clear()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        # A block holds a hash only while it is the cached one (cache_blocks keeps twins out).
        assert self.cached.get(block.block_hash) is block, block
        del self.cached[block.block_hash]
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(BlockRemoved([block.block_hash]))
        block.block_hash = None
        self.num_evictions += 1

    def check_integrity(self) -> None:
        """free + cached + in use == total, where cached blocks are free blocks still holding a
        hash; free-queue membership matches ref counts; the index points at blocks with its hash.
        Blocks never made are free and hold no hash (they are all in the queue's never-used range)."""
        made = self.blocks.made
        in_use = sum(1 for b in made if b.ref_cnt > 0)
        cached = sum(1 for b in made if b.ref_cnt == 0 and b.block_hash is not None)
        free = self.num_free_blocks - cached
        assert free + cached + in_use == self.num_blocks, (free, cached, in_use, self.num_blocks)
        for block in made:
            assert block.ref_cnt >= 0
            assert (block.ref_cnt == 0) == (block.block_id in self.free_queue), block
        assert len(made) == self.num_blocks or len(made) in self.free_queue
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash
        assert sum(1 for b in made if b.block_hash is not None) == len(self.cached), \
            "a block holds a hash it is not cached under"
