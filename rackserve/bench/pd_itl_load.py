"""One phase of `rackserve bench pd-itl`: its load and what it measures.

Decode lanes stream short-prompt completions back to back, straight to the instance that decodes
(the decoder of a P/D pair, or the colocated instance). Their short prompts are prefilled there,
as llm-d's decider (router/disagg.py, `--pd-threshold-tokens`) runs a prompt that short, so the
lanes give the decoder the same decode load in both phases whatever the prefiller is doing, and
their gaps are the decoder's own ITL (no relay hop). In the mixed phase long prompts also arrive
at a fixed interval through the setup's front (P/D: the proxy, so the prefiller computes them and
the decoder pulls their KV and decodes). Per phase it records the lanes' ITLs, their decode
concurrency, and the decoder's own view from its /metrics: running requests (sampled), tokens
generated, KV blocks pulled.

This file generates load and measures; it never starts or stops an instance.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import time

SAMPLE_S = 0.5     # the decoder's /metrics is read this often (both phases alike)
COUNTERS = ("generation_tokens_total", "kv_transfer_blocks_total", "external_prefix_cache_hits_total")


async def _stream(http, url: str, model: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Chunk arrival times of one streamed completion."""
    times = []
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0.0}
    async with http.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                times.append(time.perf_counter())
    return times


async def scrape(http, url: str) -> dict[str, float]:
    """The decoder's gauges and counters this bench reads, summed over their label sets."""
    text = (await http.get(url + "/metrics")).text
    values: dict[str, float] = {}
    for name in ("num_requests_running", "num_requests_waiting", *COUNTERS):
        values[name] = sum(float(m[1]) for m in re.finditer(rf"^rackserve:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))
    return values


def busy_share(spans: list[tuple[float, float]], start: float, end: float) -> float:
    """Time-weighted number of spans open over [start, end]: the streams decoding at once."""
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans) / (end - start)


def itl_stats(itls: list[float]) -> dict:
    # Inclusive, as bench serve's np.percentile: a phase with few gaps never reports a P99 past its largest.
    q = statistics.quantiles(itls, n=100, method="inclusive")
    return {"itl_count": len(itls), "itl_p50_ms": statistics.median(itls) * 1e3, "itl_p90_ms": q[89] * 1e3,
            # Stalls rarer than one gap in ten (a long prompt's prefill beside decodes) show here only.
            "itl_p99_ms": q[98] * 1e3, "itl_max_ms": max(itls) * 1e3}


async def run_phase(lane_url: str, long_url: str, model: str, args: argparse.Namespace, mixed: bool,
                    rng: random.Random) -> dict:
    """Decode lanes for args.duration seconds (plus long prompts when `mixed`): their ITLs and
    the decoder's load."""
    import httpx
    itls: list[float] = []
    spans: list[tuple[float, float]] = []
    long_done: list[float] = []
    running: list[float] = []

    def prompt(n: int) -> list[int]:   # fresh tokens: no prefix hit anywhere
        return [rng.randrange(100, args.max_token_id) for _ in range(n)]

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as http:
        before = await scrape(http, lane_url)
        start = time.perf_counter()
        end = start + args.duration

        async def lane() -> None:
            while time.perf_counter() < end:
                times = await _stream(http, lane_url, model, prompt(args.decode_prompt_tokens), args.decode_tokens)
                # Every gap of a stream started in the phase, those after its end too: a stall
                # that straddles the end still counts.
                itls.extend(b - a for a, b in zip(times[1:], times[2:]))
                spans.append((times[0], times[-1]))

        async def long_prompt() -> None:
            sent = time.perf_counter()
            reply = await http.post(long_url + "/v1/completions", json={
                "model": model, "prompt": prompt(args.long_prompt_tokens), "max_tokens": args.long_output_tokens,
                "ignore_eos": True, "temperature": 0.0})
            reply.raise_for_status()
            long_done.append(time.perf_counter() - sent)

        async def arrivals() -> list[asyncio.Task]:
            tasks = []
            while mixed and time.perf_counter() < end:
                tasks.append(asyncio.create_task(long_prompt()))
                await asyncio.sleep(args.long_interval)
            return tasks

        async def sample() -> None:
            while time.perf_counter() < end:
                running.append((await scrape(http, lane_url))["num_requests_running"])
                await asyncio.sleep(SAMPLE_S)

        results = await asyncio.gather(arrivals(), sample(), *[lane() for _ in range(args.decode_lanes)])
        await asyncio.gather(*results[0])
        after = await scrape(http, lane_url)
    if len(itls) < 2:
        raise RuntimeError(f"only {len(itls)} ITLs in {args.duration} s: lengthen --duration")
    return {"phase": "mixed" if mixed else "decode-only", **itl_stats(itls),
            "lane_streams": len(spans), "lane_concurrency": busy_share(spans, start, end),
            "decoder_running_mean": statistics.fmean(running), "decoder_running_max": max(running),
            **{"decoder_" + name.removesuffix("_total"): after[name] - before[name] for name in COUNTERS},
            "long_prompts": len(long_done),
            "long_latency_p50_s": statistics.median(long_done) if long_done else None}
