"""The block pool makes blocks on first use: a pool of a million blocks starts at once, and its
free queue hands out, finds and evicts blocks in exactly the order of a fully built queue (an
OrderedDict of every block, as the pool kept before)."""
from __future__ import annotations

import random
import time
from collections import OrderedDict

import pytest

from rackserve.core.block_pool import BlockPool


def test_a_million_block_pool_starts_at_once():
    start = time.perf_counter()
    pool = BlockPool(1_000_000)
    assert time.perf_counter() - start < 0.05
    assert pool.num_free_blocks == 1_000_000 and len(pool.blocks.made) == 0
    assert [b.block_id for b in pool.get_new_blocks(3)] == [0, 1, 2]
    assert len(pool.blocks.made) == 3 and pool.num_free_blocks == 999_997 and pool.usage() == pytest.approx(3e-6)


@pytest.mark.parametrize("num_blocks,most", [(40, 4), (300, 40)])   # most: a request's blocks at once
def test_the_free_queue_order_is_a_fully_built_queues(num_blocks, most):
    rng = random.Random(0)
    pool = BlockPool(num_blocks)
    queue = OrderedDict((i, None) for i in range(num_blocks))       # the eager reference: ids, front first
    held: list[int] = []
    for step in range(3000):
        op = rng.random()
        if op < 0.4 and queue:
            n = rng.randint(1, min(most, len(queue)))
            got = [b.block_id for b in pool.get_new_blocks(n)]
            assert got == [queue.popitem(last=False)[0] for _ in range(n)], step
            held += got
            hashes = [hash((step, i)) for i in range(n)]
            if rng.random() < 0.6:      # cache some of them, as full blocks are
                pool.cache_blocks([pool.blocks[i] for i in got], hashes, 0, n, [0] * n, 1)
        elif op < 0.8 and held:
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            freed, held = held[:k], held[k:]
            for i in freed:
                pool.free_blocks([pool.blocks[i]])
                if pool.blocks[i].ref_cnt == 0:         # uncached blocks go to the front
                    queue[i] = None
                    queue.move_to_end(i, last=pool.blocks[i].block_hash is not None)
        elif pool.cached:               # a prefix hit takes a cached block back, free or not
            block = pool.blocks[rng.choice(sorted(b.block_id for b in pool.cached.values()))]
            if block.ref_cnt == 0:
                del queue[block.block_id]
            pool.touch([block])
            held.append(block.block_id)
        assert [b.block_id for b in pool.free_queue.values()] == list(queue), step
        assert pool.num_free_blocks == len(queue)
    pool.check_integrity()


def test_blocks_index_as_a_list_and_out_of_range_fails():
    pool = BlockPool(5)
    assert pool.blocks[-1].block_id == 4 and pool.blocks[2].block_id == 2 and len(pool.blocks) == 5
    for bad in (5, -6):
        with pytest.raises(IndexError):
            pool.blocks[bad]
    assert [b.block_id for b in pool.blocks] == [0, 1, 2, 3, 4]
