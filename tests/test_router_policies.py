"""Routing policies on a hand-built index and loads (no processes): Dynamo's kv cost, its tie
rule and temperature, SGLang's prefix rule, the baselines; and the DP rank a router pins being
the one the engine core uses."""
from __future__ import annotations

from collections import Counter

import pytest

from rackserve.core.kv_events import BlockStored
from rackserve.core.request import Request
from rackserve.router.index import KVIndex, WorkerKey
from rackserve.router.load import ActiveLoads
from rackserve.router.policies import create_policy
from rackserve.sampling_params import SamplingParams

A, B, C = WorkerKey("a", 0), WorkerKey("a", 1), WorkerKey("b", 0)
HASHES = [11, 12, 13, 14]


def index_with(**cached: list[int]) -> KVIndex:
    index = KVIndex()
    for name, hashes in cached.items():
        index.apply({"A": A, "B": B, "C": C}[name], BlockStored(hashes, None, [0] * 4 * len(hashes), 4))
    return index


def test_kv_prefers_the_longest_cached_prefix_until_load_outweighs_it():
    index, loads = index_with(A=[11, 12, 13], B=[11]), ActiveLoads()
    kv = create_policy("kv", seed=0)
    assert kv.choose(HASHES, [A, B, C], index, loads) == (A, 3)
    # One unfinished request of 3 other blocks on A: A = 1 + (3 + 4), B = 3 + 4, C = 4 + 4.
    loads.add("r1", A, [21, 22, 23], prefill_blocks=0.0)
    assert kv.choose(HASHES, [A, B, C], index, loads) == (B, 1)
    loads.finish("r1")
    assert kv.choose(HASHES, [A, B, C], index, loads).worker == A
    # Queued prefill counts until the first token.
    loads.add("r2", A, [31], prefill_blocks=5.0)
    assert kv.choose(HASHES, [A, B, C], index, loads).worker == B
    loads.first_token("r2")
    assert loads.get(A).prefill_blocks == 0 and loads.get(A).active_blocks == 1


def test_kv_cost_is_dynamos_potential_prefill_and_decode_blocks():
    """Dynamo's cost on a hand-built state: overlap_weight x (the request's uncached blocks + the
    worker's queued prefill, in tokens / block size) + (the worker's distinct active blocks + the
    request's blocks not among them)."""
    index, loads = index_with(A=[11, 12, 13], C=[11]), ActiveLoads()
    # On A: two unfinished requests sharing blocks 11, 12 (a common prefix): 4 distinct blocks,
    # not 6; one still prefilling 1.5 blocks' worth of tokens (a partial last block counts).
    loads.add("a1", A, [11, 12, 41], prefill_blocks=0.0)
    loads.add("a2", A, [11, 12, 42], prefill_blocks=1.5)
    assert vars(loads.get(A)) == {"active_requests": 2, "active_blocks": 4, "prefill_blocks": 1.5}
    # On C: one request of unrelated blocks.
    loads.add("c1", C, [51, 52], prefill_blocks=0.0)
    kv = create_policy("kv", overlap_weight=2.0, seed=0)
    costs, overlaps = kv.costs(HASHES, [A, B, C], index, loads)
    # A: uncached 1, queued 1.5; active 4, new 2 (13, 14: 11, 12 are already active there).
    # B: nothing cached or active: 4 uncached, 4 new. C: 3 uncached, active 2 + new 4.
    assert costs == [2.0 * (1 + 1.5) + (4 + 2), 2.0 * 4 + 4, 2.0 * 3 + (2 + 4)]
    assert kv.choose(HASHES, [A, B, C], index, loads) == (A, 3)
    # A shared block is freed with the last request holding it.
    loads.finish("a1")
    assert loads.get(A).active_blocks == 3 and loads.new_blocks(A, HASHES) == 2
    loads.finish("a2")
    assert vars(loads.get(A)) == {"active_requests": 0, "active_blocks": 0, "prefill_blocks": 0.0}
    assert loads.new_blocks(A, HASHES) == 4


def test_kv_counts_the_request_own_blocks_where_they_are_not_active_yet():
    """Equal caches and equal active blocks: the worker whose unfinished requests already hold
    the prompt's prefix adds fewer blocks by taking it (Dynamo's new_blocks), so it wins."""
    index, loads = index_with(A=[11, 12], C=[11, 12]), ActiveLoads()
    loads.add("a", A, [11, 12, 61], prefill_blocks=0.0)
    loads.add("c", C, [71, 72, 73], prefill_blocks=0.0)
    assert create_policy("kv", seed=0).choose(HASHES, [A, C], index, loads).worker == A


def test_queued_prefill_in_tokens():
    from rackserve.router.load import uncached_prefill_blocks
    assert uncached_prefill_blocks(num_tokens=70, overlap_blocks=2, block_size=16) == 38 / 16
    assert uncached_prefill_blocks(num_tokens=30, overlap_blocks=2, block_size=16) == 0.0
    assert uncached_prefill_blocks(num_tokens=30, overlap_blocks=0, block_size=0) == 0.0


def test_kv_breaks_ties_by_the_smaller_index_then_at_random():
    index, loads = index_with(A=[99, 98]), ActiveLoads()
    kv = create_policy("kv", seed=0)
    assert {kv.choose(HASHES, [A, B, C], index, loads).worker for _ in range(50)} == {B, C}


def test_kv_temperature_samples_by_cost():
    index, loads = index_with(A=HASHES), ActiveLoads()
    kv = create_policy("kv", temperature=1.0, seed=1)
    picks = Counter(kv.choose(HASHES, [A, C], index, loads).worker for _ in range(400))
    assert picks[A] > picks[C] > 0


def test_prefix_follows_what_it_routed_unless_queues_are_imbalanced():
    policy, index, loads = create_policy("prefix", balance_abs_threshold=2, seed=0), KVIndex(), ActiveLoads()
    first = policy.choose(HASHES, [A, C], index, loads).worker
    assert policy.choose(HASHES, [A, C], index, loads).worker == first        # match rate 1.0
    other = C if first == A else A
    assert policy.choose([7, 8, 9], [A, C], index, loads).worker == other     # no match: smaller tree
    for i in range(4):
        loads.add(f"r{i}", first, [100 + i], 0.0)
    assert policy.choose(HASHES, [A, C], index, loads).worker == other        # imbalanced: shortest queue


def test_baselines():
    index, loads = KVIndex(), ActiveLoads()
    rr = create_policy("round_robin")
    assert [rr.choose(HASHES, [A, B, C], index, loads).worker for _ in range(4)] == [A, B, C, A]
    loads.add("r", A, [1], 1.0)
    assert create_policy("least_load", seed=0).choose(HASHES, [A, C], index, loads).worker == C
    with pytest.raises(ValueError, match="unknown routing policy"):
        create_policy("fastest")


def test_index_drops_a_worker_and_reports_overlaps():
    index = index_with(A=[11, 12], C=[11, 12, 13])
    assert index.overlaps(HASHES) == {A: 2, C: 3}
    index.remove_worker(C)
    assert index.overlaps(HASHES) == {A: 2} and index.num_blocks() == 2 and 13 not in index.owners


def test_the_engine_core_honours_a_pinned_dp_rank():
    from tests.test_kv_events import FakeExecutor, config
    from rackserve.engine.core import EngineCore
    core = EngineCore(config(2), FakeExecutor(num_blocks=16, dp=2))
    for i in range(3):
        assert core.add_requests([Request(f"r{i}", [1, 2, 3], SamplingParams())], dp_rank=1) == 1
    assert [len(s.waiting) for s in core.schedulers] == [0, 3]
    assert core.add_requests([Request("free", [1, 2, 3], SamplingParams())]) == 0   # placement: least load


def test_the_router_hashes_a_cache_salt_as_the_instances_do():
    from rackserve.core.hashing import block_hashes
    from rackserve.router.router import Router
    router = Router(["http://a", "http://b"], create_policy("kv", seed=0))
    router.block_size = 4
    for instance in router.instances.values():
        instance.healthy, instance.info = True, {"data_parallel_size": 1}
    tokens = list(range(16))
    a, b = WorkerKey("http://a", 0), WorkerKey("http://b", 0)
    router.index.apply(a, BlockStored(block_hashes(tokens, 4, salt="tenant"), None, tokens, 4))
    router.index.apply(b, BlockStored(block_hashes(tokens, 4), None, tokens, 4))
    assert router.route(tokens, cache_salt="tenant") == (a, 4, 4)
    assert router.route(tokens) == (b, 4, 4)
    assert router.route(tokens, exclude={"http://a", "http://b"}) is None


def test_bench_router_runs_kv_once_per_overlap_weight():
    from rackserve.bench.router_bench import policy_runs
    assert policy_runs("kv", "measured") == [("kv", ["--policy", "kv"])]   # the router's learned prices
    assert policy_runs("kv,prefix", "1,4") == [
        ("kv@1", ["--policy", "kv", "--overlap-weight", "1"]), ("kv@4", ["--policy", "kv", "--overlap-weight", "4"]),
        ("prefix", ["--policy", "prefix"])]
    assert policy_runs("round_robin,kv", "2") == [("round_robin", ["--policy", "round_robin"]),
                                                  ("kv", ["--policy", "kv", "--overlap-weight", "2"])]


def test_kv_logs_each_decision_that_leaves_the_best_cached_worker(caplog):
    import json
    import logging
    index, loads = index_with(A=[11, 12, 13]), ActiveLoads()
    loads.add("busy", A, [81, 82, 83, 84, 85], prefill_blocks=0.0)
    kv = create_policy("kv", seed=0)
    with caplog.at_level(logging.DEBUG, logger="rackserve.router.policies"):
        assert kv.choose(HASHES, [A, C], index, loads).worker == C     # A = 1 + (5 + 4), C = 4 + (0 + 4)
        loads.finish("busy")
        assert kv.choose(HASHES, [A, C], index, loads).worker == A     # not moved: not logged
    [record] = [r for r in caplog.records if "kv moved off cache" in r.getMessage()]
    moved = json.loads(record.getMessage().split(": ", 1)[1])
    assert moved["chosen"] == "b#0" and moved["prompt_blocks"] == 4
    assert moved["workers"][0] == {"worker": "a#0", "cost": 10.0, "cached_blocks": 3, "uncached_blocks": 1,
                                   "new_blocks": 4, "active_requests": 1, "active_blocks": 5, "prefill_blocks": 0.0}


def test_kv_prefill_keeps_a_long_session_on_the_rank_that_caches_it():
    """Contexts of 100K+ tokens: a session's 400 cached blocks on A, while A decodes one more long
    request (500 active blocks) than B. kv's decode term (one block for one block) moves the
    session to B, recomputing all of it; kv_prefill (the least uncached work) keeps it on A, and
    still leaves A once A's queued prefill outweighs what A caches."""
    prompt = list(range(1000, 1402))                                    # 402 blocks, 400 cached on A
    index, loads = index_with(A=prompt[:400]), ActiveLoads()
    loads.add("long", A, list(range(5000, 5500)), prefill_blocks=0.0)   # decoding, 500 blocks
    assert create_policy("kv", seed=0).choose(prompt, [A, B], index, loads) == (B, 0)
    assert create_policy("kv_prefill", seed=0).choose(prompt, [A, B], index, loads) == (A, 400)
    costs, _ = create_policy("kv_prefill", seed=0).costs(prompt, [A, B], index, loads)
    assert costs == [2, 402]
    loads.add("queued", A, list(range(6000, 6401)), prefill_blocks=401.0)
    assert create_policy("kv_prefill", seed=0).choose(prompt, [A, B], index, loads) == (B, 0)
