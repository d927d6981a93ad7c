"""HybridKVCacheManager (core/, no torch): a sliding group whose blocks behind the window go back to
the pool while a request runs, compressed groups hit by hash, and the bounded replay a hit needs."""
import pytest

from rackserve.core.hybrid_kv_cache_manager import HybridHit, HybridKVCacheManager
from rackserve.core.kv_cache_groups import KVCacheConfig, KVCacheGroup
from rackserve.core.request import Request
from rackserve.sampling_params import SamplingParams

BS, WINDOW, LAYERS = 4, 8, 3
KEEP = 15   # tokens the sliding group keeps: max(window - 1, the compressor's open groups)


def config(num_blocks: int = 128, window_blocks: int = 64) -> KVCacheConfig:
    return KVCacheConfig((KVCacheGroup("window", BS, window_blocks, 100.0, sliding_window=KEEP),
                          KVCacheGroup("csa", BS, num_blocks, 10.0, lookback=4),
                          KVCacheGroup("hca", 4 * BS, num_blocks, 1.0)), WINDOW, LAYERS)


def request(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=1000))


def step(kv: HybridKVCacheManager, req: Request, n: int, hit=None) -> tuple[list[int], ...]:
    ids = kv.allocate_slots(req, n, hit) if hit is not None else kv.allocate_slots(req, n)
    assert ids is not None
    if hit is not None:
        req.num_computed_tokens = hit.num_tokens
    req.num_computed_tokens += n
    return ids


@pytest.fixture
def kv():
    manager = HybridKVCacheManager(config(), BS)
    yield manager
    manager.check_integrity()


def test_a_long_decode_holds_a_bounded_window_and_every_compressed_block(kv):
    req = request("a", list(range(100, 130)))
    step(kv, req, 30)
    bound = -(-KEEP // BS) + 2
    for i in range(300):
        req.append_output_token(7 + i % 50)
        step(kv, req, 1)
        assert kv.num_held_blocks(req, 0) <= bound
        assert kv.num_held_blocks(req, 1) == -(-req.num_computed_tokens // BS)
        assert kv.num_held_blocks(req, 2) == -(-req.num_computed_tokens // (4 * BS))
    # The window's blocks went back to its pool as the request went on.
    assert kv.pools[0].num_free_blocks >= kv.pools[0].num_blocks - bound
    kv.free(req)
    assert kv.usage() == 0.0


def test_a_hit_reuses_compressed_blocks_and_replays_a_bounded_span(kv):
    tokens = list(range(200, 300))
    first = request("a", tokens)
    step(kv, first, 100)
    kv.free(first)
    again = request("b", tokens + [5])
    hit = kv.get_computed_blocks(again)
    assert isinstance(hit, HybridHit)
    # Prefix found up to 96 (whole hca blocks of 16); the window's layers need 3 x 7 tokens
    # before it, and the entries after the last hit block 2 x 7 before them (minus CSA's lookback).
    assert hit.num_hit_tokens == 96
    assert hit.num_tokens == min(96 - 21, 96 - 4 - 14, 96 - 14) // BS * BS == 72
    assert [len(b) for b in hit.blocks] == [24, 6]
    ids = step(kv, again, again.num_tokens - hit.num_tokens, hit)
    assert kv.hit_blocks(again) == (0, 24, 6)
    # The replay's window blocks start a window before its first token; the table reads block 0
    # before them.
    first = (72 - KEEP) // BS
    table = kv.block_ids(again)
    assert table[0][:first] == [0] * first and len(ids[0]) == -(-again.num_tokens // BS) - first
    assert table[1][:24] == [b.block_id for b in hit.blocks[0]]


def test_a_prefix_too_short_to_replay_is_no_hit(kv):
    first = request("a", list(range(24)))
    step(kv, first, 24)
    kv.free(first)
    assert kv.get_computed_blocks(request("b", list(range(24)) + [1])).num_tokens == 0


def test_too_few_blocks_in_any_group_changes_nothing():
    kv = HybridKVCacheManager(config(window_blocks=5), BS)
    req = request("a", list(range(30)))
    assert kv.allocate_slots(req, 30) is None        # 8 window blocks for 30 tokens: 5 free
    assert kv.usage() == 0.0 and not kv.req_to_blocks
    step(kv, req, 16)
    assert kv.allocate_slots(req, 14) is None        # the window keeps 15 tokens: 8 blocks again
    kv.check_integrity()
    kv.free(req)
    assert kv.usage() == 0.0


def test_replay_start_follows_the_receptive_field_of_stacked_windows():
    c = config()
    # One layer: a window before the hit is enough.
    one = KVCacheConfig(c.groups, window=8, num_layers=1)
    assert one.replay_start(400, [100, 25], 1) == min(400 - 7, 400 - 4, 400)
    # Three layers: three windows; no compressed block hit at all means nothing to save.
    assert c.replay_start(400, [100, 25], 1) == 400 - 21
    assert c.replay_start(400, [0, 0], BS) == 0


def test_kv_arriving_from_elsewhere_gets_the_window_its_next_token_reads_and_is_cached_once_landed():
    """A load (delay_caching) of a 200-token prompt through a window group of 8 blocks: the window
    group allocates only the blocks holding the last KEEP tokens before the next one, the
    compressed groups every block; nothing joins the prefix cache until the next allocation."""
    kv = HybridKVCacheManager(config(window_blocks=8), BS)
    req = request("r", list(range(3, 204)))   # 201 tokens: 200 arrive, the last is computed here
    ids = kv.allocate_slots(req, 200, delay_caching=True)
    assert ids is not None
    window, csa, hca = kv.transfer_block_ids(req)
    first_kept = (200 - KEEP) // BS
    assert window[:first_kept] == [None] * first_kept and None not in window[first_kept:]
    assert len(window) == 50 and len(csa) == 50 and len(hca) == 13
    assert kv.pools[1].get_cached_block(kv._hashes(req, 1)[0]) is None   # not hit before it landed
    req.num_computed_tokens = 200
    assert kv.allocate_slots(req, 1) is not None   # landed: the next token is computed here
    assert kv.pools[1].get_cached_block(kv._hashes(req, 1)[0]) is not None
    kv.free(req)
    kv.check_integrity()
