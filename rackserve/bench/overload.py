"""`rackserve bench overload`: how many requests per second a server sustains, and what it does
past that. Open-loop arrivals at each offered rate in turn (the client never waits for an answer
before sending the next request, as users do not), small completions, and per rate: answered
requests per second, the share refused with 429 (back-pressure, --max-waiting-requests), other
failures, and latency percentiles of the answered ones.

This file owns the arrival loop and its summary. It must never judge a server by a timed
threshold (it reports) and never touch the engine: it speaks HTTP only.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

from rackserve.serve.cli import register_subcommand


async def _run_rate(session, url: str, body: dict, rate: float, duration: float) -> dict:
    """Send `rate` requests per second for `duration` seconds; wait for every answer."""
    statuses: list[int] = []
    latencies: list[float] = []

    async def one() -> None:
        start = time.monotonic()
        try:
            async with session.post(url, json=body) as resp:
                await resp.read()
                statuses.append(resp.status)
                if resp.status == 200:
                    latencies.append(time.monotonic() - start)
        except Exception:  # noqa: BLE001 - a refused or dropped connection is a result too
            statuses.append(0)

    tasks = []
    begin = time.monotonic()
    for i in range(int(rate * duration)):
        delay = begin + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one()))
    sent_for = time.monotonic() - begin
    await asyncio.gather(*tasks)
    drained = time.monotonic() - begin
    ok = statuses.count(200)
    # "inclusive", as bench serve's np.percentile: a few samples never give a P99 past the max.
    quantiles = (statistics.quantiles(latencies, n=100, method="inclusive") if len(latencies) >= 2
                 else [float("nan")] * 99)
    return {"offered_rps": rate, "sent": len(statuses), "sent_seconds": round(sent_for, 3),
            "answered_rps": round(ok / drained, 2), "ok": ok, "refused_429": statuses.count(429),
            "other_failures": len(statuses) - ok - statuses.count(429),
            "latency_p50_s": round(quantiles[49], 4), "latency_p99_s": round(quantiles[98], 4)}


def _add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    parser.add_argument("--rates", default="25,50,100,200,400", help="offered requests per second, in turn")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals per rate")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens per completion")
    parser.add_argument("--output", default=None, help="write the results as JSON here")


@register_subcommand("bench overload", "open-loop request rates against a server: sustained requests/s, "
                     "429 share past capacity, latency", _add_args)
def _bench_overload(args: argparse.Namespace) -> int:
    import aiohttp

    from rackserve.bench.limits import processor_name

    async def main() -> list[dict]:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
            model = args.model
            if model is None:
                async with session.get(f"{args.url}/v1/models") as resp:
                    model = (await resp.json())["data"][0]["id"]
            body = {"model": model, "prompt": "Hello, my name is", "max_tokens": args.max_tokens,
                    "temperature": 0.0, "ignore_eos": True}
            results = []
            for rate in (float(r) for r in args.rates.split(",")):
                result = await _run_rate(session, f"{args.url}/v1/completions", body, rate, args.duration)
                print(json.dumps(result), flush=True)
                results.append(result)
            return results

    results = asyncio.run(main())
    clean = [r for r in results if r["refused_429"] == 0 and r["other_failures"] == 0]
    sustained = max((r["answered_rps"] for r in clean), default=0.0)
    print(f"sustained without refusals: {sustained} requests/s; first 429 at offered "
          f"{next((r['offered_rps'] for r in results if r['refused_429']), 'none')} requests/s")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"bench": "overload", "command": "rackserve " + " ".join(sys.argv[1:]),
                       "processor": processor_name(), "max_tokens": args.max_tokens,
                       "sustained_rps": sustained, "rates": results}, f, indent=1)
    return 0
