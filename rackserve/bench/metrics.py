"""The arithmetic of a serving benchmark run, as InferenceX/AgentX define it (reference/agentx.md):
throughput per device, TTFT / ITL / E2EL percentiles, P90 interactivity, hit rates, and the rules
that mark a run invalid.

T = max(end) - min(start) over the measured requests; throughput per device = (input tokens,
cached and uncached, + output tokens) / T / devices; per-request ITL = (E2EL - TTFT) / (output
tokens - 1) (TPOT is the same number); P90 interactivity = 1 / P90(ITL). Input tokens are the
server-reported prompt tokens. A run is invalid when more than 1% of its requests fail on context
overflow or more than 10% fail. Percentiles interpolate linearly between order statistics
(numpy's default).

This file owns RequestRecord (what the client measures of one request) and RunSummary. It must
never talk to a server nor read a clock.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

CONTEXT_OVERFLOW = "context_overflow"
MAX_OVERFLOW_SHARE = 0.01
MAX_FAILURE_SHARE = 0.10


@dataclass
class RequestRecord:
    """One request as the client saw it; times are seconds since the run began."""
    lane: int
    play: int
    session_id: str
    turn: int                           # index among the turns of its (sub)session
    kind: str                           # "main", "subagent" or "warmup" (warm-ups are not measured)
    input_len: int                      # prompt tokens the workload asked for
    max_tokens: int
    start: float
    end: float = math.nan
    first_chunk: float | None = None    # the first streamed chunk with text
    chunk_times: list[float] = field(default_factory=list)   # every chunk with text
    prompt_tokens: int | None = None    # usage.prompt_tokens
    cached_tokens: int | None = None    # usage.prompt_tokens_details.cached_tokens
    output_tokens: int | None = None    # usage.completion_tokens
    error: str | None = None            # failure kind: context_overflow, http_4xx, timeout...
    error_message: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def measured(self) -> bool:
        return self.kind != "warmup"

    @property
    def ttft(self) -> float | None:
        return None if self.first_chunk is None else self.first_chunk - self.start

    @property
    def e2el(self) -> float:
        return self.end - self.start

    @property
    def itl(self) -> float | None:
        """(E2EL - TTFT) / (output tokens - 1); None below two output tokens."""
        if self.ttft is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict:
        d = asdict(self)
        d["chunk_times"] = [round(t, 6) for t in self.chunk_times]
        return d


@dataclass(frozen=True)
class Percentiles:
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: list[float]) -> "Percentiles":
        if not values:
            return cls(math.nan, math.nan, math.nan, math.nan)
        p50, p90, p99 = np.percentile(values, [50, 90, 99])
        return cls(float(np.mean(values)), float(p50), float(p90), float(p99))


@dataclass(frozen=True)
class RunSummary:
    concurrency: int
    devices: int
    requests: int                       # measured requests sent
    completed: int
    warmups: int
    failures: dict[str, int]            # by kind, over every request sent (warm-ups too)
    duration: float                     # T, seconds
    input_tokens: int                   # server-reported prompt tokens of completed measured requests
    cached_tokens: int
    output_tokens: int
    short_outputs: int                  # completed with fewer tokens than max_tokens (EOS not ignored?)
    throughput_per_device: float        # (input + output) tokens / T / devices
    input_throughput_per_device: float
    output_throughput_per_device: float
    requests_per_second: float
    ttft: Percentiles
    itl: Percentiles                    # = TPOT
    e2el: Percentiles
    interactivity_p90: float            # 1 / P90(ITL), tokens/s/user
    interactivity_p50: float
    hit_rate: float | None              # prefix-cache hit tokens / prompt tokens of the measured requests
    hit_rate_source: str                # "usage.cached_tokens", "server metrics" or "unavailable"
    request_hit_rate: float | None      # from usage.cached_tokens of the measured requests
    server_hit_rate: float | None       # the server's counters over the run: warm-ups included
    input_source: str                   # "usage.prompt_tokens" or "workload" when a server omits usage
    valid: bool
    invalid_reasons: list[str]

    def to_json(self) -> dict:
        return asdict(self)


def summarize(records: list[RequestRecord], concurrency: int, devices: int,
              server_hits: tuple[float, float] | None = None) -> RunSummary:
    """`server_hits` is (hit tokens, queried tokens) from the server's counters over the run."""
    assert devices > 0, "devices must be > 0"
    measured = [r for r in records if r.measured]
    done = [r for r in measured if r.ok]
    failures = Counter(r.error for r in records if not r.ok)
    duration = max(r.end for r in done) - min(r.start for r in done) if done else 0.0
    with_usage = all(r.prompt_tokens is not None for r in done)
    input_tokens = sum((r.prompt_tokens if with_usage else r.input_len) for r in done)
    output_tokens = sum(r.output_tokens or 0 for r in done)
    cached = [r.cached_tokens for r in done if r.cached_tokens is not None]
    request_hit_rate = None
    if done and len(cached) == len(done) and with_usage and input_tokens:
        request_hit_rate = sum(cached) / input_tokens
    server_hit_rate = server_hits[0] / server_hits[1] if server_hits is not None and server_hits[1] > 0 else None
    # The measured requests' own usage first: the same requests as every other figure here, and
    # the same rule on every server. The counters also count the warm-ups, whose sessions start
    # cold: that put rackserve 4-15 points below llama-server's usage-based rate on one replay.
    if request_hit_rate is not None:
        hit_rate, source = request_hit_rate, "usage.cached_tokens"
    elif server_hit_rate is not None:
        hit_rate, source = server_hit_rate, "server metrics"
    else:
        hit_rate, source = None, "unavailable"
    itl = Percentiles.of([r.itl for r in done if r.itl is not None])

    def rate(tokens: float) -> float:
        return tokens / duration / devices if duration > 0 else 0.0

    reasons = invalid_reasons(len(records), failures)
    if not done:
        reasons.append("no request completed")
    return RunSummary(
        concurrency=concurrency, devices=devices, requests=len(measured), completed=len(done),
        warmups=len(records) - len(measured), failures=dict(failures), duration=duration,
        input_tokens=input_tokens, cached_tokens=sum(cached), output_tokens=output_tokens,
        short_outputs=sum(1 for r in done if (r.output_tokens or 0) < r.max_tokens),
        throughput_per_device=rate(input_tokens + output_tokens), input_throughput_per_device=rate(input_tokens),
        output_throughput_per_device=rate(output_tokens),
        requests_per_second=len(done) / duration if duration > 0 else 0.0,
        ttft=Percentiles.of([r.ttft for r in done if r.ttft is not None]), itl=itl,
        e2el=Percentiles.of([r.e2el for r in done]),
        interactivity_p90=_inverse(itl.p90), interactivity_p50=_inverse(itl.p50),
        hit_rate=hit_rate, hit_rate_source=source, request_hit_rate=request_hit_rate, server_hit_rate=server_hit_rate,
        input_source="usage.prompt_tokens" if with_usage else "workload",
        valid=not reasons, invalid_reasons=reasons)


def invalid_reasons(sent: int, failures: Counter) -> list[str]:
    """The AgentX rules: more than 1% of requests failing on context overflow, or more than 10%
    failing, make a run invalid."""
    if not sent:
        return ["no request was sent"]
    reasons = []
    overflow = failures.get(CONTEXT_OVERFLOW, 0)
    if overflow > MAX_OVERFLOW_SHARE * sent:
        reasons.append(f"{overflow} of {sent} requests ({overflow / sent:.1%}) overflowed the context (limit 1%)")
    failed = sum(failures.values())
    if failed > MAX_FAILURE_SHARE * sent:
        reasons.append(f"{failed} of {sent} requests ({failed / sent:.1%}) failed (limit 10%)")
    return reasons


def _inverse(seconds: float) -> float:
    return 1.0 / seconds if seconds > 0 else math.nan
