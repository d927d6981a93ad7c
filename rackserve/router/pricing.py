"""Prices: what a worker's prefill and decode cost in seconds, learned from the router's own
streams, so the kv policy can weigh cache against load in time instead of in blocks.

Dynamo prices one uncached prefill block like one active decode block (`--overlap-weight` 1),
a rule made on GPUs where decode steps read the KV of every active block. On other hardware the
ratio differs (on a one-thread CPU instance a decode step reads the weights once for the whole
batch, so another decoding request costs little, while a recomputed block costs real prefill
time). Like llm-d's latency predictor (TTFT and TPOT per pod, trained online on live traffic)
and Dynamo's planner profiles (prefill time against input length, ITL against active KV), the
router fits, per worker, two lines on what it observes anyway:

- TTFT = first_token_s + prefill_s_per_block x (queued prefill blocks ahead + the request's own
  uncached blocks): one point per streamed request, at its first token;
- ITL = step_s + step_s_per_block x (the worker's mean active blocks while the request decoded):
  one point per streamed request whose usage reports at least 2 output tokens;

and the mean output tokens per request (the workload's, one for all workers). A request's price
on a worker is then its predicted end-to-end seconds there (`Price.seconds`): TTFT at the
worker's prefill load, plus the expected output tokens times the step time at its decode load.
Fits forget old points exponentially (the instance's load and the workload drift); a worker with
too few points of its own is priced with the fit of all workers' points, and before the pool
has enough points there is no price (the kv policy then uses Dynamo's block rule).

This file owns the fits only: it never routes and never reads a clock.
"""
from __future__ import annotations

from dataclasses import dataclass

from rackserve.router.index import WorkerKey

FORGET = 0.98        # weight of a point after each newer one: about the last 50 points count
MIN_POINTS = 8       # points a fit needs before it prices anything
FLAT = 0.05          # x spread (std / mean) below which a slope cannot be told from noise


class LinearFit:
    """y = a + b x by least squares over exponentially forgotten points (decayed sums). Slope and
    intercept stay >= 0 (neither a negative prefill time nor a step that gets faster with load is
    a price); when x barely varies only one of the two can be known, and `flat_slope` says which:
    True, the line through the origin (b = mean y / mean x), False, the level (a = mean y, b = 0)."""

    def __init__(self, flat_slope: bool) -> None:
        self.flat_slope = flat_slope
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0     # forgotten sums
        self.count = 0

    def add(self, x: float, y: float) -> None:
        self.count += 1
        self.n = FORGET * self.n + 1.0
        self.sx = FORGET * self.sx + x
        self.sy = FORGET * self.sy + y
        self.sxx = FORGET * self.sxx + x * x
        self.sxy = FORGET * self.sxy + x * y

    def line(self) -> tuple[float, float] | None:
        """(a, b), or None before MIN_POINTS points."""
        if self.count < MIN_POINTS:
            return None
        mx, my = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mx * mx
        if var <= (FLAT * mx) ** 2:
            if self.flat_slope and mx > 0:
                return 0.0, max(my / mx, 0.0)
            return max(my, 0.0), 0.0
        b = max((self.sxy / self.n - mx * my) / var, 0.0)
        a = my - b * mx
        if a < 0:   # refit through the origin: the points say the fixed part is nothing
            return 0.0, max(self.sxy / self.sxx, 0.0)
        return a, b


@dataclass(frozen=True)
class Price:
    first_token_s: float          # fixed part of TTFT (a step, the HTTP round trip)
    prefill_s_per_block: float    # prefill seconds per uncached block, queued or its own
    step_s: float                 # decode step seconds with no active block (weights, sampling)
    step_s_per_block: float       # what each active block adds to a decode step
    output_tokens: float          # expected output tokens of a request

    def seconds(self, prefill_blocks: float, decode_blocks: float) -> float:
        """Predicted end-to-end seconds of a request on a worker that would carry `prefill_blocks`
        of prefill up to its first token and `decode_blocks` active blocks while it decodes."""
        ttft = self.first_token_s + self.prefill_s_per_block * prefill_blocks
        return ttft + self.output_tokens * (self.step_s + self.step_s_per_block * decode_blocks)


class Prices:
    def __init__(self) -> None:
        self._ttft: dict[WorkerKey, LinearFit] = {}
        self._itl: dict[WorkerKey, LinearFit] = {}
        self._all_ttft, self._all_itl = LinearFit(flat_slope=True), LinearFit(flat_slope=False)
        self._outputs = self._output_n = 0.0     # forgotten sum and count of output tokens

    def first_token(self, worker: WorkerKey, prefill_blocks: float, ttft_s: float) -> None:
        """A streamed request's first token came `ttft_s` after it was routed to `worker`, which
        then had `prefill_blocks` of prefill up to it (queued ahead plus its own)."""
        for fit in (self._ttft.setdefault(worker, LinearFit(flat_slope=True)), self._all_ttft):
            fit.add(prefill_blocks, ttft_s)

    def decoded(self, worker: WorkerKey, mean_active_blocks: float, itl_s: float, output_tokens: int) -> None:
        """A streamed request's output tokens came every `itl_s` seconds on `worker`, whose active
        blocks averaged `mean_active_blocks` meanwhile."""
        for fit in (self._itl.setdefault(worker, LinearFit(flat_slope=False)), self._all_itl):
            fit.add(mean_active_blocks, itl_s)
        self._outputs = FORGET * self._outputs + output_tokens
        self._output_n = FORGET * self._output_n + 1.0

    def price(self, worker: WorkerKey) -> Price | None:
        """The worker's price from its own points, or from all workers' where it has too few."""
        ttft = _own_or_all(self._ttft.get(worker), self._all_ttft)
        itl = _own_or_all(self._itl.get(worker), self._all_itl)
        if ttft is None or itl is None:
            return None
        return Price(*ttft, *itl, self._outputs / self._output_n)


def _own_or_all(own: LinearFit | None, pooled: LinearFit) -> tuple[float, float] | None:
    return (own.line() if own is not None else None) or pooled.line()
