"""The benchmark arithmetic against values computed by hand from synthetic timestamps: T,
throughput per device, percentiles, ITL, interactivity, hit rates, and the invalid-run rules."""
from __future__ import annotations

import math
from collections import Counter

import pytest

from rackserve.bench.metrics import RequestRecord, invalid_reasons, summarize


def record(start: float, first: float | None, end: float, prompt: int, cached: int, out: int, max_tokens: int,
           kind: str = "main", error: str | None = None) -> RequestRecord:
    return RequestRecord(lane=0, play=0, session_id="s", turn=0, kind=kind, input_len=prompt - 10,
                         max_tokens=max_tokens, start=start, end=end, first_chunk=first,
                         chunk_times=[] if first is None else [first, end], prompt_tokens=prompt,
                         cached_tokens=cached, output_tokens=out, error=error)


RECORDS = [
    record(0.0, 0.5, 2.5, prompt=1000, cached=800, out=5, max_tokens=5),     # ITL (2.5-0.5)/4 = 0.5
    record(1.0, 1.2, 2.2, prompt=500, cached=0, out=11, max_tokens=12),      # ITL 1.0/10 = 0.1; short
    record(2.0, 2.4, 4.0, prompt=300, cached=256, out=1, max_tokens=1),      # one token: no ITL
    record(3.0, None, 3.1, prompt=0, cached=0, out=0, max_tokens=8, error="context_overflow"),
    record(-5.0, -1.0, -0.9, prompt=2000, cached=0, out=1, max_tokens=1, kind="warmup"),
]


def test_summary_matches_hand_computed_values():
    s = summarize(RECORDS, concurrency=2, devices=2, server_hits=(50.0, 100.0))
    # T spans the completed measured requests only: min start 0.0 (warm-up left out), max end 4.0.
    assert s.duration == pytest.approx(4.0)
    assert (s.requests, s.completed, s.warmups) == (4, 3, 1)
    assert (s.input_tokens, s.cached_tokens, s.output_tokens) == (1800, 1056, 17)
    assert s.throughput_per_device == pytest.approx((1800 + 17) / 4.0 / 2)
    assert s.input_throughput_per_device == pytest.approx(1800 / 8)
    assert s.output_throughput_per_device == pytest.approx(17 / 8)
    assert s.requests_per_second == pytest.approx(3 / 4.0)
    # ITL [0.5, 0.1]: linear interpolation gives P50 0.3 and P90 0.1 + 0.9 * 0.4 = 0.46.
    assert s.itl.p50 == pytest.approx(0.3) and s.itl.p90 == pytest.approx(0.46)
    assert s.itl.mean == pytest.approx(0.3)
    assert s.interactivity_p90 == pytest.approx(1 / 0.46)
    assert s.interactivity_p50 == pytest.approx(1 / 0.3)
    # TTFT sorted [0.2, 0.4, 0.5]: P50 0.4, P90 0.4 + 0.8 * 0.1, P99 0.4 + 0.98 * 0.1.
    assert (s.ttft.p50, s.ttft.p90, s.ttft.p99) == pytest.approx((0.4, 0.48, 0.498))
    # E2EL sorted [1.2, 2.0, 2.5].
    assert (s.e2el.p50, s.e2el.p90) == pytest.approx((2.0, 2.4))
    assert s.short_outputs == 1
    # The measured requests' usage, not the server's counters (which count the warm-up too).
    assert s.hit_rate == s.request_hit_rate == pytest.approx(1056 / 1800) and s.hit_rate_source == "usage.cached_tokens"
    assert s.server_hit_rate == pytest.approx(0.5)
    assert s.input_source == "usage.prompt_tokens"
    # 1 failure of 5 requests sent: 20% overflow (limit 1%) and 20% failed (limit 10%).
    assert s.failures == {"context_overflow": 1}
    assert not s.valid and len(s.invalid_reasons) == 2


def test_hit_rate_falls_back_to_usage_without_server_counters():
    s = summarize(RECORDS[:3], concurrency=1, devices=1)
    assert s.hit_rate == pytest.approx(1056 / 1800) and s.hit_rate_source == "usage.cached_tokens"
    assert s.server_hit_rate is None and s.valid and s.failures == {}


def test_hit_rate_falls_back_to_the_server_counters_without_cached_tokens_in_usage():
    plain = [record(0.0, 0.1, 1.0, prompt=100, cached=0, out=3, max_tokens=3)]
    plain[0].cached_tokens = None
    s = summarize(plain, concurrency=1, devices=1, server_hits=(30.0, 100.0))
    assert s.hit_rate == s.server_hit_rate == pytest.approx(0.3) and s.hit_rate_source == "server metrics"


def test_input_falls_back_to_the_workload_when_a_server_sends_no_usage():
    plain = record(0.0, 0.1, 1.0, prompt=0, cached=0, out=3, max_tokens=3)
    plain.prompt_tokens = plain.cached_tokens = None
    s = summarize([plain], concurrency=1, devices=1)
    assert s.input_source == "workload" and s.input_tokens == plain.input_len
    assert s.hit_rate is None and s.hit_rate_source == "unavailable"


def test_per_request_itl_and_ttft():
    r = record(10.0, 10.25, 11.0, prompt=100, cached=0, out=4, max_tokens=4)
    assert r.ttft == pytest.approx(0.25) and r.e2el == pytest.approx(1.0)
    assert r.itl == pytest.approx(0.75 / 3)


@pytest.mark.parametrize("overflow, other, valid", [(1, 0, True), (2, 0, False), (0, 10, True), (0, 11, False)])
def test_invalid_run_rules(overflow, other, valid):
    failures = Counter({"context_overflow": overflow, "http_500": other})
    assert (not invalid_reasons(100, +failures)) == valid


def test_a_run_without_completions_is_invalid_and_has_no_rates():
    s = summarize([RECORDS[3]], concurrency=1, devices=1)
    assert not s.valid and "no request completed" in s.invalid_reasons
    assert s.throughput_per_device == 0.0 and math.isnan(s.interactivity_p90)
