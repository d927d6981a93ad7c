"""The kv policy's prices (router/pricing.py, router/load.py): lines fitted on given points, the
prices ActiveLoads learns from timed streams on a fake clock, and the kv cost in predicted
seconds on hand-built states, against Dynamo's block rule."""
from __future__ import annotations

import pytest

from rackserve.core.kv_events import BlockStored
from rackserve.router.index import KVIndex, WorkerKey
from rackserve.router.load import ActiveLoads
from rackserve.router.policies import create_policy
from rackserve.router.pricing import MIN_POINTS, LinearFit, Price

A, C = WorkerKey("a", 0), WorkerKey("c", 0)


def test_a_fit_recovers_a_line_and_prices_nothing_before_enough_points():
    fit = LinearFit(flat_slope=True)
    for x in range(MIN_POINTS - 1):
        fit.add(x, 0.1 + 0.05 * x)
    assert fit.line() is None
    fit.add(20, 0.1 + 0.05 * 20)
    assert fit.line() == pytest.approx((0.1, 0.05))
    # Newer points outweigh older ones: the line follows an instance that got slower.
    for x in range(200):
        fit.add(x % 10, 0.2 + 0.1 * (x % 10))
    assert fit.line() == pytest.approx((0.2, 0.1), rel=0.02)   # 0.98 ** 200: 2% of the old left


def test_a_fit_whose_x_barely_varies_keeps_the_part_it_can_know():
    ttft, itl = LinearFit(flat_slope=True), LinearFit(flat_slope=False)
    for _ in range(10):
        ttft.add(4.0, 0.2)
        itl.add(30.0, 0.05)
    assert ttft.line() == pytest.approx((0.0, 0.05))     # through the origin: seconds per block
    assert itl.line() == pytest.approx((0.05, 0.0))      # a level: the step time, no slope
    # Neither a negative intercept nor a negative slope is a price.
    fit = LinearFit(flat_slope=True)
    for x in range(10):
        fit.add(x + 1, 0.1 * (x + 1) - 0.05)
    a, b = fit.line()
    assert a == 0.0 and b > 0
    falling = LinearFit(flat_slope=False)
    for x in range(10):
        falling.add(x, 1.0 - 0.01 * x)
    assert falling.line()[1] == 0.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_active_loads_learn_ttft_and_itl_lines_from_timed_streams():
    """One request at a time on A, so the prefill ahead of each is its own and its mean active
    blocks are its own blocks: TTFT = 0.1 + 0.05 x prefill blocks, ITL = 0.02 + 0.001 x blocks."""
    clock = Clock()
    loads = ActiveLoads(clock)
    assert loads.price(A) is None
    for i in range(12):
        blocks = 2 + 3 * i
        loads.add(f"r{i}", A, list(range(1000 * i, 1000 * i + blocks)), prefill_blocks=blocks + 0.5)
        clock.now += 0.1 + 0.05 * (blocks + 0.5)
        loads.first_token(f"r{i}")
        clock.now += 9 * (0.02 + 0.001 * blocks)          # 10 output tokens
        loads.finish(f"r{i}", output_tokens=10)
        clock.now += 1.0                                   # idle between requests: no blocks
    price = loads.price(A)
    assert vars(price) == pytest.approx({"first_token_s": 0.1, "prefill_s_per_block": 0.05, "step_s": 0.02,
                                         "step_s_per_block": 0.001, "output_tokens": 10.0})
    # A worker with no points of its own is priced with all workers' points.
    assert loads.price(C) == price
    # What teaches nothing: a request finished without a first token (not streamed, or failed),
    # or a stream without usage; an untimed ActiveLoads prices nothing.
    loads.add("plain", C, [1, 2], prefill_blocks=2.0)
    clock.now += 30.0
    loads.finish("plain", output_tokens=10)
    loads.add("no-usage", C, [1, 2], prefill_blocks=2.0)
    loads.first_token("no-usage")
    clock.now += 30.0
    loads.finish("no-usage")
    assert loads.price(C) != price                         # its TTFT point counts ...
    assert loads.price(C).step_s == pytest.approx(0.02)    # ... but no ITL point came
    untimed = ActiveLoads()
    untimed.add("r", A, [1], 1.0)
    untimed.first_token("r")
    untimed.finish("r", output_tokens=10)
    assert untimed.price(A) is None


def test_the_mean_active_blocks_of_a_decode_are_a_time_average():
    clock = Clock()
    loads = ActiveLoads(clock)
    loads.add("long", A, [1, 2, 3, 4], prefill_blocks=0.0)
    loads.first_token("long")
    clock.now += 1.0                                       # 4 blocks for 1 s
    loads.add("other", A, [3, 4, 5, 6, 7, 8], prefill_blocks=0.0)
    clock.now += 1.0                                       # 8 distinct blocks for 1 s
    assert loads.block_seconds(A) == pytest.approx(12.0)
    seen = []
    loads.prices.decoded = lambda worker, mean, itl, n: seen.append((worker, mean, itl, n))
    loads.finish("long", output_tokens=5)
    assert seen == [(A, pytest.approx(6.0), pytest.approx(0.5), 5)]


def index_with(**cached: list[int]) -> KVIndex:
    index = KVIndex()
    for name, hashes in cached.items():
        index.apply({"A": A, "C": C}[name], BlockStored(hashes, None, [0] * 4 * len(hashes), 4))
    return index


CPU = Price(first_token_s=0.05, prefill_s_per_block=0.06, step_s=0.03, step_s_per_block=0.0001,
            output_tokens=100.0)


def priced(loads: ActiveLoads, prices: dict) -> ActiveLoads:
    loads.price = prices.get
    return loads


def test_kv_cost_is_the_predicted_seconds_and_keeps_a_session_where_dynamos_blocks_move_it():
    """The case the block rule decided wrongly on one-thread CPU instances: the holder caches 6
    blocks more but carries 22 more active blocks. In blocks (weight 1) 22 > 6 moves the request;
    in seconds a recomputed block (0.06 s) outweighs 100 steps x 0.0001 s per active block."""
    prompt = list(range(1, 13))                                         # 12 blocks
    index = index_with(A=prompt[:10], C=prompt[:4])
    loads = priced(ActiveLoads(), {A: CPU, C: CPU})
    loads.add("a", A, list(range(100, 122)), prefill_blocks=0.5)        # 22 blocks, still prefilling
    kv = create_policy("kv", seed=0)
    costs, _ = kv.costs(prompt, [A, C], index, loads)
    # A: 2 uncached + 0.5 queued; 22 active + 12 new. C: 8 uncached; 0 active + 12 new.
    assert costs == pytest.approx([0.05 + 0.06 * 2.5 + 100 * (0.03 + 0.0001 * 34),
                                   0.05 + 0.06 * 8 + 100 * (0.03 + 0.0001 * 12)])
    assert kv.choose(prompt, [A, C], index, loads).worker == A
    # --overlap-weight is the user's override: Dynamo's rule in blocks, whatever was learned.
    assert create_policy("kv", overlap_weight=1.0, seed=0).choose(prompt, [A, C], index, loads).worker == C
    # Costs compare only in one unit: a worker without a price puts the decision on blocks (weight 1).
    assert create_policy("kv", seed=0).costs(prompt, [A, C], index, priced(loads, {A: CPU}))[0] == [2.5 + 34, 8 + 12]


def test_kv_in_seconds_still_spreads_load_where_decode_is_dear():
    """Where an active block costs more than the cache saves (a GPU-like price), the same state
    goes to the idle worker: the rule prices, it does not pin sessions."""
    gpu = Price(first_token_s=0.01, prefill_s_per_block=0.001, step_s=0.01, step_s_per_block=0.0005,
                output_tokens=100.0)
    prompt = list(range(1, 13))
    index, loads = index_with(A=prompt[:10], C=prompt[:4]), priced(ActiveLoads(), {A: gpu, C: gpu})
    loads.add("a", A, list(range(100, 122)), prefill_blocks=0.0)
    assert create_policy("kv", seed=0).choose(prompt, [A, C], index, loads).worker == C
