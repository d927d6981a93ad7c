"""The block pool's blocks, made on first use, and its free queue with a never-used range.

A cache of 100 GiB holds ~470K blocks a DP rank; building them all when an engine starts cost
seconds (and the simulator's big runs one such pool a rank). Here a block object is made the
first time anyone asks for it, and the free queue keeps the blocks never handed out as a range of
ids, not as entries. The queue's order is exactly the one a fully built queue would have.
This file owns no policy (BlockPool decides what is freed where) and never imports torch.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain

from rackserve.core.hashing import BlockHash


@dataclass(eq=False, slots=True)    # millions of them in a rack-size simulation: 136 bytes each, not 176
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None   # set once the block is full and registered in the cache


class BlockList(Sequence[KVBlock]):
    """blocks[i] for i < num_blocks; block i is made when first indexed. Iterating makes them all
    (integrity checks only); `made` is the prefix made so far: every other block is untouched."""

    def __init__(self, num_blocks: int):
        self._num_blocks = num_blocks
        self.made: list[KVBlock] = []

    def __len__(self) -> int:
        return self._num_blocks

    def __getitem__(self, i):       # type: ignore[override]  (ints only: slices make no sense here)
        made = self.made
        if i < 0:
            i += self._num_blocks
        if not 0 <= i < len(made):
            if not 0 <= i < self._num_blocks:
                raise IndexError(i)
            made.extend(KVBlock(j) for j in range(len(made), i + 1))
        return made[i]

    def made_range(self, start: int, stop: int) -> list[KVBlock]:
        """blocks[start:stop], made at once where not made yet."""
        made = self.made
        if len(made) < stop:
            made.extend(map(KVBlock, range(len(made), stop)))
        return made[start:stop]

    def __iter__(self) -> Iterator[KVBlock]:
        if self._num_blocks:
            self[self._num_blocks - 1]
        return iter(self.made)


class FreeBlockQueue:
    """Free blocks in eviction order: blocks freed to the front (newest first), then the ids never
    handed out (ascending, as a fully built queue starts), then blocks freed to the back (oldest
    first). Removal from the middle is O(1) for blocks that have been handed out."""

    def __init__(self, blocks: BlockList):
        self._blocks = blocks
        self._front: OrderedDict[int, KVBlock] = OrderedDict()
        self._back: OrderedDict[int, KVBlock] = OrderedDict()
        self._next_fresh = 0        # ids >= this were never handed out and wait in the middle

    def __len__(self) -> int:
        return len(self._front) + len(self._blocks) - self._next_fresh + len(self._back)

    def __contains__(self, block_id: int) -> bool:
        return block_id >= self._next_fresh or block_id in self._front or block_id in self._back

    def popleft(self) -> KVBlock:
        if self._front:
            return self._front.popitem(last=False)[1]
        if self._next_fresh < len(self._blocks):
            self._next_fresh += 1
            return self._blocks[self._next_fresh - 1]
        return self._back.popitem(last=False)[1]

    def popleft_fresh(self, n: int) -> list[KVBlock]:
        """What n popleft() calls hand out while they hand out never-used blocks (the front empty),
        at most n: made and taken at once (a long prompt's hundreds of blocks)."""
        if self._front:
            return []
        start = self._next_fresh
        self._next_fresh = min(start + n, len(self._blocks))
        return self._blocks.made_range(start, self._next_fresh)

    def remove(self, block: KVBlock) -> None:
        # Only blocks that were handed out can be found again (they alone hold hashes).
        assert block.block_id < self._next_fresh, block
        if self._front.pop(block.block_id, None) is None:
            del self._back[block.block_id]

    def push_front(self, block: KVBlock) -> None:
        self._front[block.block_id] = block
        self._front.move_to_end(block.block_id, last=False)

    def push_back(self, block: KVBlock) -> None:
        self._back[block.block_id] = block

    def values(self) -> Iterator[KVBlock]:
        """Every free block, front first (makes the never-used ones: tests and checks only)."""
        fresh = (self._blocks[i] for i in range(self._next_fresh, len(self._blocks)))
        return chain(self._front.values(), fresh, self._back.values())
