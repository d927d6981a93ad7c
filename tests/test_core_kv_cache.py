"""BlockPool and KVCacheManager: prefix hits, eviction order, reference counts."""
import pytest

from rackserve.core.block_pool import BlockPool
from rackserve.core.kv_cache_manager import KVCacheManager
from rackserve.core.request import Request
from rackserve.sampling_params import SamplingParams

BS = 4


def make_request(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=8))


def admit(kv: KVCacheManager, req: Request) -> int:
    """Admit a request as the scheduler does; returns the number of prefix-hit tokens."""
    hit = kv.get_computed_blocks(req)
    ids = kv.allocate_slots(req, req.num_tokens - hit.num_tokens, hit)
    assert ids is not None
    req.num_computed_tokens = req.num_tokens
    return hit.num_tokens


@pytest.fixture
def kv():
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    yield manager
    manager.check_integrity()


def test_prefix_hit_in_whole_blocks_and_last_token_recomputed(kv):
    a = make_request("a", list(range(10)))           # 2 full blocks + 2 tokens
    assert admit(kv, a) == 0
    b = make_request("b", list(range(10)) + [77])    # same first 2 blocks
    assert admit(kv, b) == 8
    assert kv.block_ids(b)[:2] == kv.block_ids(a)[:2]
    # A prompt that is exactly the cached blocks still recomputes its last token.
    c = make_request("c", list(range(8)))
    assert admit(kv, c) == 4
    for r in (a, b, c):
        kv.free(r)


def test_shared_blocks_are_reference_counted(kv):
    a = make_request("a", list(range(9)))
    b = make_request("b", list(range(9)))
    admit(kv, a)
    admit(kv, b)
    shared = kv.block_ids(a)[:2]
    assert all(kv.pool.blocks[i].ref_cnt == 2 for i in shared)
    kv.free(a)
    assert all(kv.pool.blocks[i].ref_cnt == 1 for i in shared)
    assert kv.usage() == pytest.approx(3 / 10)
    kv.free(b)
    assert kv.usage() == 0.0


def test_eviction_takes_uncached_then_least_recently_freed_tails_first(kv):
    a = make_request("a", list(range(12)))           # 3 full blocks, all cached
    admit(kv, a)
    a_blocks = kv.block_ids(a)
    kv.free(a)
    b = make_request("b", [100 + i for i in range(13)])   # 3 full + 1 partial block
    admit(kv, b)
    b_blocks = kv.block_ids(b)
    kv.free(b)
    # b's partial block holds no hash, so it is reused first; then a's blocks, tail first.
    order = [blk.block_id for blk in kv.pool.free_queue.values()]
    assert order[0] == b_blocks[3]
    cached_order = [i for i in order if kv.pool.blocks[i].block_hash is not None]
    assert cached_order[:3] == list(reversed(a_blocks))
    # Fill the cache so that exactly a's last block is evicted: a then hits 2 blocks only.
    # Free queue now: b's partial, the 3 never-used blocks, a's blocks tail first, b's tail first.
    filler = make_request("f", [500 + i for i in range(5 * BS)])
    admit(kv, filler)
    free_before = kv.pool.num_free_blocks
    assert kv.get_computed_blocks(make_request("a2", list(range(12)) + [1])).num_tokens == 8
    assert kv.pool.num_free_blocks == free_before
    kv.free(filler)


def test_allocation_fails_cleanly_when_full(kv):
    big = make_request("big", list(range(36)))      # 9 blocks
    admit(kv, big)
    other = make_request("other", [900 + i for i in range(8)])
    assert kv.allocate_slots(other, 8) is None
    assert "other" not in kv.req_to_blocks
    kv.free(big)
    assert admit(kv, other) == 0
    kv.free(other)


def test_hit_blocks_in_the_free_queue_count_against_free_space():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(9)))            # 3 blocks: 2 cached + 1 partial
    admit(kv, a)
    kv.free(a)
    b = make_request("b", list(range(8)) + list(range(50, 58)))   # hits 2, needs 2 more
    hit = kv.get_computed_blocks(b)
    assert hit.num_tokens == 8
    assert kv.allocate_slots(b, 8, hit) is not None  # 2 hit (free) + 2 new == 4 free
    kv.check_integrity()
    c = make_request("c", [70, 71])
    assert kv.allocate_slots(c, 2) is None


def test_disabled_caching_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    kv.free(a)
    assert admit(kv, make_request("b", list(range(9)))) == 0
    assert not kv.pool.cached


def test_pool_rejects_double_free():
    pool = BlockPool(2)
    [blk] = pool.get_new_blocks(1)
    pool.free_blocks([blk])
    with pytest.raises(AssertionError):
        pool.free_blocks([blk])


def test_block_id_view_reads_as_the_table_and_keeps_its_ids_as_it_grows(kv):
    """What the scheduler tells a connector each step: the ids block_ids lists, read in place."""
    a = make_request("a", list(range(10)))
    admit(kv, a)
    view = kv.block_id_view(a)
    ids = kv.block_ids(a)
    assert len(view) == 3 and list(view) == ids and view[1] == ids[1] and view[-1] == ids[-1]
    assert view[1:] == ids[1:] and view == ids
    for t in range(6):                            # decoded tokens: the table grows, the ids read before stay
        a.append_output_token(100 + t)
    assert kv.allocate_slots(a, 6) is not None
    assert list(view) == kv.block_ids(a) and list(view)[:3] == ids and len(view) == 4
    kv.free(a)
    assert list(kv.block_id_view(a)) == [] and list(view)[:3] == ids
