"""KV events: the BlockPool emits one event per store, eviction and reset, in vLLM's wire format
(checked with a decoder written here from vLLM's schema, not ours), and replaying them rebuilds
exactly each DP rank's cached set, including after a late subscribe through the replay socket."""
from __future__ import annotations

import random
import time
from typing import Any

import msgspec
import pytest
import zmq

from rackserve.config import CacheConfig, EngineConfig, KVEventsConfig, ModelConfig, ParallelConfig, SchedulerConfig
from rackserve.core.block_pool import BlockPool
from rackserve.core.hashing import block_hashes
from rackserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from rackserve.core.outputs import ModelRunnerOutput
from rackserve.core.request import Request
from rackserve.distributed.parallel_state import free_port
from rackserve.engine.core import EngineCore
from rackserve.engine.kv_event_publisher import KVEventPublisher
from rackserve.engine.kv_events import decode_batch, encode_batch
from rackserve.engine.stats import IterationStats
from rackserve.executor.base import Executor
from rackserve.router.index import KVIndex, WorkerKey
from rackserve.sampling_params import SamplingParams


# -- vLLM's schema (vllm/distributed/kv_events.py), written out here independently ----------
class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(VEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VBlockRemoved(VEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None


class VAllBlocksCleared(VEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(VEventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


vllm_decoder = msgspec.msgpack.Decoder(type=VKVEventBatch)


# vLLM's later schema: the fields hybrid (multi-group) caches use, in its order.
class VGroupBlockStored(VBlockStored, tag="BlockStored"):
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VGroupBlockRemoved(VBlockRemoved, tag="BlockRemoved"):
    group_idx: int | None = None


class VGroupKVEventBatch(VEventBatch):
    events: list[VGroupBlockStored | VGroupBlockRemoved | VAllBlocksCleared]


vllm_group_decoder = msgspec.msgpack.Decoder(type=VGroupKVEventBatch)

BS = 4


def test_wire_format_is_vllms():
    events = [BlockStored([11, 2**64 - 1], None, list(range(8)), BS), BlockRemoved([11]), AllBlocksCleared()]
    payload = encode_batch(123.5, events, 1)
    # Untyped: an array [ts, events, dp_rank], each event an array opening with its tag.
    raw = msgspec.msgpack.decode(payload)
    assert raw == [123.5, [["BlockStored", [11, 2**64 - 1], None, list(range(8)), BS, None, "GPU",
                            None, None, None, None, None],     # lora_name .. kv_cache_spec_sliding_window
                           ["BlockRemoved", [11], "GPU", None], ["AllBlocksCleared"]], 1]
    batch = vllm_decoder.decode(payload)
    assert batch.ts == 123.5 and batch.data_parallel_rank == 1
    stored, removed, cleared = batch.events
    assert isinstance(stored, VBlockStored) and stored.block_hashes == [11, 2**64 - 1]
    assert stored.parent_block_hash is None and stored.token_ids == list(range(8)) and stored.block_size == BS
    assert isinstance(removed, VBlockRemoved) and removed.block_hashes == [11]
    assert isinstance(cleared, VAllBlocksCleared)


def test_duplicate_block_stores_nothing_and_holds_no_hash():
    pool = BlockPool(8, enable_kv_cache_events=True)
    tokens = list(range(2 * BS))
    hashes = block_hashes(tokens, BS)
    first, second = pool.get_new_blocks(2), pool.get_new_blocks(2)
    pool.cache_blocks(first, hashes, 0, 2, tokens, BS)
    pool.cache_blocks(second, hashes, 0, 2, tokens, BS)   # computed again by a concurrent request
    assert pool.take_events() == [BlockStored(hashes, None, tokens, BS)]
    assert [b.block_hash for b in second] == [None, None]
    assert all(pool.cached[h] is b for h, b in zip(hashes, first))
    pool.free_blocks(reversed(second))
    pool.free_blocks(reversed(first))
    pool.check_integrity()
    # The twins are reused before the cached blocks, and evicting never touches the cache.
    assert {b.block_id for b in pool.get_new_blocks(2)} == {b.block_id for b in second}
    assert pool.take_events() == []
    assert len(pool.get_new_blocks(6)) == 6
    # Freed tail first, so the tail goes first: one event per eviction.
    assert pool.take_events() == [BlockRemoved([hashes[1]]), BlockRemoved([hashes[0]])]


class FakeExecutor(Executor):
    """Two DP ranks with small caches; samples a token from the history, like a model would."""

    def __init__(self, num_blocks: int, dp: int) -> None:
        self.num_kv_blocks, self.model_max_len, self.vocab_size, self.dp = num_blocks, 64, 100, dp
        self.requests: dict[str, list[int]] = {}

    @property
    def dp_num_kv_blocks(self) -> list[int]:
        return [self.num_kv_blocks] * self.dp

    def execute(self, scheduler_output):
        raise AssertionError("execute_dp only")

    def execute_dp(self, scheduler_outputs):
        return [ModelRunnerOutput([], [], []) for _ in scheduler_outputs]


def config(dp: int) -> EngineConfig:
    return EngineConfig(ModelConfig("m", "m", "m", "float32", "cpu", 64, 0), CacheConfig(BS, 1.0, True, None),
                        SchedulerConfig(8, 24), ParallelConfig(data_parallel_size=dp),
                        kv_events=KVEventsConfig(enable_kv_cache_events=True))


def step(core: EngineCore, rng: random.Random):
    """One step whose 'model' samples for every request whose KV caught up."""
    sos = [s.schedule() for s in core.schedulers]
    outs = []
    for s, so in zip(core.schedulers, sos):
        ids = [r for r in so.num_scheduled_tokens if s.requests[r].num_computed_tokens == s.requests[r].num_tokens]
        outs.append(ModelRunnerOutput(ids, [[rng.randrange(100)] for _ in ids], [None] * len(ids)))
    for s, so, ro in zip(core.schedulers, sos, outs):
        s.update_from_output(so, ro)
    return core.make_stats(outs)


def test_replayed_events_equal_each_dp_ranks_cached_set():
    rng = random.Random(0)
    core = EngineCore(config(2), FakeExecutor(num_blocks=16, dp=2))
    index = KVIndex()
    prefixes = [[rng.randrange(100) for _ in range(rng.randrange(4, 24))] for _ in range(6)]
    seen: set[str] = set()
    n = preemptions = 0
    for i in range(300):
        if rng.random() < 0.5:
            prompt = rng.choice(prefixes) + [rng.randrange(100) for _ in range(rng.randrange(1, 12))]
            core.add_requests([Request(f"r{n}", prompt, SamplingParams(max_tokens=rng.randrange(1, 30)))])
            n += 1
        if rng.random() < 0.05 and core.has_unfinished_requests():
            victim = rng.choice([r for s in core.schedulers for r in s.requests])
            core.abort_requests([victim])
        idle = [s for s in core.schedulers if not s.has_unfinished_requests()]
        if idle and rng.random() < 0.3:
            assert rng.choice(idle).kv.pool.reset_prefix_cache()
        stats = step(core, rng)
        preemptions += stats.num_preemptions
        for rank, rank_stats in enumerate(stats.dp_ranks):
            seen.update(type(e).__name__ for e in rank_stats.kv_events)
            if rank_stats.kv_events:
                payload = encode_batch(time.time(), rank_stats.kv_events, rank)
                assert len(vllm_decoder.decode(payload).events) == len(rank_stats.kv_events)
                batch = decode_batch(payload)   # the router's decoder
                for event in batch.events:
                    index.apply(WorkerKey("i", batch.data_parallel_rank), event)
        for rank, s in enumerate(core.schedulers):
            assert index.blocks.get(WorkerKey("i", rank), set()) == set(s.kv.pool.cached), i
        core.check_integrity()
    assert seen == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    assert preemptions > 0
    assert sum(s.kv.pool.num_evictions for s in core.schedulers) > 0


def test_publisher_sends_three_frames_and_replays_to_a_late_subscriber():
    pub_port, replay_port = free_port(), free_port()
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{pub_port}",
                         replay_endpoint=f"tcp://*:{replay_port}", topic="kv", buffer_steps=3)
    publisher = KVEventPublisher(cfg, data_parallel_size=1)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    try:
        from rackserve.core.stats import DPRankStats, SchedulerStats
        batches = [[BlockStored([i], None, [i] * BS, BS)] for i in range(5)]
        time.sleep(0.3)   # PUB/SUB: a subscriber hears only what is sent after it joined
        for events in batches:
            publisher.record(SchedulerStats(dp_ranks=[DPRankStats(kv_events=events)]), IterationStats())
        for seq in range(5):
            assert sub.poll(5000), "no batch arrived"
            topic, seq_bytes, payload = sub.recv_multipart()
            assert topic == b"kv" and int.from_bytes(seq_bytes, "big") == seq
            assert vllm_decoder.decode(payload).events[0].block_hashes == [seq]
        # A late subscriber asks from seq 1; only the last buffer_steps=3 batches are kept.
        replay = ctx.socket(zmq.DEALER)
        replay.setsockopt(zmq.LINGER, 0)
        replay.connect(f"tcp://127.0.0.1:{replay_port}")
        replay.send_multipart([b"", (1).to_bytes(8, "big")])
        got = []
        while True:
            assert replay.poll(5000), "replay did not answer"
            _, seq_bytes, payload = replay.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == -1:
                break
            got.append((seq, vllm_decoder.decode(payload).events[0].block_hashes))
        assert got == [(2, [2]), (3, [3]), (4, [4])]
        replay.close()
    finally:
        sub.close()
        publisher.shutdown()


def test_a_taken_port_fails_at_startup():
    port = free_port()
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}")
    first = KVEventPublisher(cfg, 1)
    try:
        with pytest.raises(ValueError, match="cannot open"):
            KVEventPublisher(cfg, 1)
    finally:
        first.shutdown()


def test_kv_events_config_refuses_unknown_keys():
    with pytest.raises(ValueError, match="keys among"):
        KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}')
    assert KVEventsConfig.from_json('{"enable_kv_cache_events": true}').endpoint == "tcp://*:5557"


def test_dp_rank_k_publishes_on_port_plus_k():
    base = free_port()
    while True:   # two consecutive free ports
        try:
            cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{base}", topic="kv")
            publisher = KVEventPublisher(cfg, data_parallel_size=2)
            break
        except ValueError:
            base = free_port()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{base + 1}")
    try:
        from rackserve.core.stats import DPRankStats, SchedulerStats
        assert [p.endpoint for p in publisher.publishers] == [f"tcp://*:{base}", f"tcp://*:{base + 1}"]
        time.sleep(0.3)
        stats = SchedulerStats(dp_ranks=[DPRankStats(), DPRankStats(kv_events=[AllBlocksCleared()])])
        publisher.record(stats, IterationStats())
        assert sub.poll(5000)
        _, seq, payload = sub.recv_multipart()
        batch = vllm_decoder.decode(payload)
        assert int.from_bytes(seq, "big") == 0 and batch.data_parallel_rank == 1
        assert isinstance(batch.events[0], VAllBlocksCleared)
    finally:
        sub.close()
        publisher.shutdown()


def test_port_0_binds_a_port_per_rank_and_names_it():
    """What `rackserve cluster` asks for: every rank's PUB and replay sockets on ports the OS picks
    as it binds, named in the publishers' endpoints (GET /kv_events), and serving there."""
    from rackserve.core.stats import DPRankStats, SchedulerStats
    from rackserve.engine.kv_events import connectable
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0", topic="kv")
    publisher = KVEventPublisher(cfg, data_parallel_size=2)
    ctx = zmq.Context.instance()
    subs = []
    try:
        ends = [p.endpoint for p in publisher.publishers] + [p.replay_endpoint for p in publisher.publishers]
        ports = [int(e.rsplit(":", 1)[1]) for e in ends]
        assert all(e.startswith("tcp://*:") for e in ends) and 0 not in ports and len(set(ports)) == 4, ends
        for p in publisher.publishers:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"kv")
            sub.connect(connectable(p.endpoint, "127.0.0.1"))
            subs.append(sub)
        time.sleep(0.3)
        publisher.record(SchedulerStats(dp_ranks=[DPRankStats(kv_events=[AllBlocksCleared()])] * 2), IterationStats())
        for rank, sub in enumerate(subs):
            assert sub.poll(5000), f"rank {rank} sent nothing to its named endpoint"
            assert vllm_decoder.decode(sub.recv_multipart()[2]).data_parallel_rank == rank
        replay = ctx.socket(zmq.DEALER)
        replay.setsockopt(zmq.LINGER, 0)
        replay.connect(connectable(publisher.publishers[1].replay_endpoint, "127.0.0.1"))
        subs.append(replay)
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        assert replay.poll(5000), "rank 1's replay did not answer at its named endpoint"
        assert int.from_bytes(replay.recv_multipart()[1], "big") == 0
    finally:
        for sub in subs:
            sub.close()
        publisher.shutdown()


def test_a_multi_group_cache_sends_each_groups_events_and_the_index_finds_its_hits():
    """DeepSeek-V4's cache (a sliding group, then compressed groups of 1 and 4 engine blocks a
    block): each prefix-cached group's stores and evictions go out with its group_idx, vLLM's
    decoders of both schemas read them, replaying them rebuilds each group's cached set, and the
    index's overlap is the hit the instance finds (cut group by group to whole blocks)."""
    from rackserve.core.hybrid_kv_cache_manager import HybridHit, HybridKVCacheManager
    from tests.test_core_kv_cache_groups import BS as GBS, config as groups_config, request, step
    kv = HybridKVCacheManager(groups_config(num_blocks=40), GBS, enable_kv_cache_events=True)
    index, worker = KVIndex(block_size=GBS), WorkerKey("i", 0)
    rng = random.Random(2)
    prefixes = [[rng.randrange(100) for _ in range(rng.randrange(20, 90))] for _ in range(4)]
    hits = 0
    for n in range(40):
        prompt = rng.choice(prefixes) + [rng.randrange(100) for _ in range(rng.randrange(1, 9))]
        req = request(f"r{n}", prompt)
        hit = kv.get_computed_blocks(req)
        if isinstance(hit, HybridHit):
            hits += 1
            assert index.overlaps(block_hashes(prompt[:-1], GBS)).get(worker, 0) * GBS == hit.num_hit_tokens
            step(kv, req, req.num_tokens - hit.num_tokens, hit)
        else:
            step(kv, req, req.num_tokens)
        kv.free(req)
        events = kv.take_events()
        assert {e.group_idx for e in events} <= {1, 2}    # the sliding group caches nothing to tell
        payload = encode_batch(0.0, events, 0)
        assert len(vllm_decoder.decode(payload).events) == len(events)    # the older schema skips the rest
        for sent, read in zip(events, vllm_group_decoder.decode(payload).events):
            assert read.group_idx == sent.group_idx and read.block_hashes == sent.block_hashes
        for event in decode_batch(payload).events:
            index.apply(worker, event)
        for group in (1, 2):
            assert index.groups[worker][group] == (kv.groups[group].block_size // GBS, set(kv.pools[group].cached))
    assert hits > 5 and sum(p.num_evictions for p in kv.pools) > 0
    kv.check_integrity()
    assert index.num_blocks(worker) == len(kv.pools[1].cached) + len(kv.pools[2].cached)
    index.remove_worker(worker)      # it left the pool
    assert index.num_blocks() == 0 and not index.overlaps(block_hashes(prefixes[0], GBS))
