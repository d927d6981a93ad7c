"""`rackserve bench serve`: AgentX-style closed-loop replay against any OpenAI-compatible server,
one run per concurrency level, the levels together making the throughput-interactivity curve.

It asks the server for its model and context length, builds the workload, prints its statistics
(with the theoretical hit rate of an infinite cache), then for each level runs the lanes with a
live display, reads the server's prefix-cache counters before and after, and prints the summary;
--output writes every run with every request's record as JSON, --plot draws the curve.

This file owns the command's flags, the display and the JSON layout. It must never compute a
metric itself (metrics.py does) nor shape requests (replay.py and client.py do).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import time
import uuid
from typing import TYPE_CHECKING

from rackserve.bench.agentx import DEFAULT_SCALE
from rackserve.bench.record import machine_state
from rackserve.serve.cli import register_subcommand

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from rackserve.bench.metrics import RunSummary
    from rackserve.bench.replay import Replay

RATE_WINDOW = 10.0                      # seconds of completions behind the live rates
KEEPALIVE_SECONDS = 1.0                 # client-side idle connection lifetime (see bench_serve)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (with or without /v1)")
    parser.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    parser.add_argument("--workload", default="agentx", help="agentx, random, or trace:FILE (weka format)")
    parser.add_argument("--concurrency", default="1,2,4,8", help="comma-separated lane counts, one run each")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds during which requests start, per run")
    parser.add_argument("--requests-per-lane", type=int, default=None,
                        help="a lane starts at most this many measured requests (main and subagent turns): a fixed "
                             "amount of work whatever the machine's speed; --duration still bounds the run")
    parser.add_argument("--devices", type=int, default=1, help="devices serving, for throughput per device")
    parser.add_argument("--seed", type=int, default=0, help="seeds the workload's content and the random starts")
    parser.add_argument("--scale", type=float, default=None,
                        help=f"agentx: multiplies every token count of the published statistics (default {DEFAULT_SCALE})")
    parser.add_argument("--output-scale", type=float, default=None,
                        help="agentx: multiplies output lengths instead (default: min(1, 10 x scale), so that "
                        "short agentic outputs stay long enough to measure inter-token latency)")
    parser.add_argument("--max-context", type=int, default=None,
                        help="the server's longest prompt + output (default: what /v1/models reports)")
    parser.add_argument("--think-time-cap", type=float, default=5.0, help="longest think time honoured, seconds")
    parser.add_argument("--tokenizer", default=None,
                        help="the server's tokenizer (a .gguf, an HF directory or a rackserve alias): prompt words "
                        "are then checked to be one token each, making prompt lengths exact")
    parser.add_argument("--eos", choices=["ignore_eos", "logit_bias", "allow"], default="ignore_eos",
                        help="how requests ask for exactly max_tokens tokens: the ignore_eos field (vLLM, llama.cpp, "
                        "rackserve), a logit_bias on EOS (needs --tokenizer; for servers that refuse unknown fields, "
                        "like transformers serve), or nothing")
    parser.add_argument("--random-input-len", type=int, default=1024, help="random: prompt tokens")
    parser.add_argument("--random-output-len", type=int, default=128, help="random: output tokens")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request fails")
    parser.add_argument("--label", default=None, help="name of this system in plots (default: the model name)")
    parser.add_argument("--output", default=None, help="write the runs and every request's record to this JSON")
    parser.add_argument("--plot", default=None, help="draw throughput per device against P90 interactivity")
    parser.add_argument("--no-progress", action="store_true", help="no live display")


@register_subcommand("bench serve", "AgentX-style closed-loop replay against an OpenAI-compatible server",
                     add_args)
def run(args: argparse.Namespace) -> int:
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
        if not levels or min(levels) < 1 or args.duration <= 0 or args.devices < 1 \
                or (args.requests_per_lane is not None and args.requests_per_lane < 1):
            raise ValueError("concurrency levels, duration, devices and requests per lane must be positive")
    except ValueError as e:
        print(f"rackserve bench serve: {e}", file=sys.stderr)
        return 2
    import aiohttp
    from rich.console import Console
    try:
        result = asyncio.run(bench_serve(args, levels, Console()))
    except (ValueError, OSError, aiohttp.ClientError) as e:
        print(f"rackserve bench serve: {e}", file=sys.stderr)
        return 1
    return write_result(result, args.output, args.plot)


def write_result(result: dict, output: str | None, plot: str | None) -> int:
    """Write a run's JSON and plot where asked; the exit code: 0 if every level is valid, else 3."""
    if output:
        with open(output, "w") as f:
            json.dump(_finite({**result, "machine": machine_state()}), f, indent=1)
        print(f"wrote {output}")
    if plot:
        from rackserve.bench.plot import plot_results
        plot_results([result], plot)
        print(f"wrote {plot}")
    return 0 if all(r["summary"]["valid"] for r in result["runs"]) else 3


async def bench_serve(args: argparse.Namespace, levels: list[int], console: Console) -> dict:
    """Every run against the server; the JSON-ready result."""
    # Imported here, not at the top: `rackserve --help` imports this file and must stay instant.
    import aiohttp

    from rackserve.bench.client import ChatClient, eos_fields, prefix_cache_counters, run_clock, served_models
    from rackserve.bench.metrics import summarize
    from rackserve.bench.replay import Replay, ReplayConfig
    from rackserve.bench.token_text import (PromptRenderer, default_vocabulary, load_server_tokenizer,
                                            vocabulary_from_tokenizer)
    from rackserve.bench.workload import WorkloadOptions, make_workload
    # Idle connections are dropped after KEEPALIVE_SECONDS, well before servers close theirs
    # (uvicorn: 5 s, as long as the default think-time cap): a POST sent on a connection the
    # server is closing at that moment fails with "Can not write request body".
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_SECONDS)
    async with aiohttp.ClientSession(connector=connector) as http:
        models = await served_models(http, args.base_url)
        if not models and not args.model:
            raise ValueError(f"{args.base_url} lists no models; name one with --model")
        model = args.model or next(iter(models))
        max_context = args.max_context or models.get(model)
        workload = make_workload(args.workload, WorkloadOptions(
            seed=args.seed, scale=args.scale, output_scale=args.output_scale, max_context=max_context,
            random_input_len=args.random_input_len, random_output_len=args.random_output_len))
        tokenizer = load_server_tokenizer(args.tokenizer) if args.tokenizer else None
        vocabulary = vocabulary_from_tokenizer(tokenizer, args.tokenizer) if tokenizer else default_vocabulary()
        if args.eos == "logit_bias" and tokenizer is None:
            raise ValueError("--eos logit_bias needs --tokenizer (to know the EOS token ids)")
        extra_fields = eos_fields(args.eos, tokenizer.eos_token_ids if tokenizer else frozenset())
        stats = workload.describe()
        console.print(f"[bold]{args.workload}[/bold] against {model} at {args.base_url} "
                      f"(context {max_context or 'not reported'}; prompt words: {vocabulary.source})")
        for line in stats.lines():
            console.print("  " + line)
        renderer = PromptRenderer(vocabulary, args.seed)
        nonce = uuid.uuid4().hex[:8]
        result = {"label": args.label or model, "base_url": args.base_url, "model": model,
                  "workload": args.workload, "scale": workload.scale, "output_scale": workload.output_scale,
                  "seed": args.seed, "devices": args.devices, "duration": args.duration,
                  "requests_per_lane": args.requests_per_lane,
                  "think_time_cap": args.think_time_cap, "max_context": max_context, "eos": args.eos,
                  "vocabulary": vocabulary.source, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "command": sys.argv, "workload_stats": dataclasses.asdict(stats), "runs": []}
        for concurrency in levels:
            config = ReplayConfig(concurrency, args.duration, args.think_time_cap, args.seed, f"{nonce}c{concurrency}",
                                  args.requests_per_lane)
            clock = run_clock()
            client = ChatClient(args.base_url, model, http, clock, args.request_timeout, extra_fields)
            replay = Replay(workload, renderer, client, config)
            before = await prefix_cache_counters(http, args.base_url)
            if args.no_progress or not console.is_terminal:
                records = await replay.run()
            else:
                records = await _with_progress(replay, clock, args, console)
            after = await prefix_cache_counters(http, args.base_url)
            server_hits = None
            if before is not None and after is not None:
                server_hits = (after[0] - before[0], after[1] - before[1])
            summary = summarize(records, concurrency, args.devices, server_hits)
            console.print(summary_table(summary))
            result["runs"].append({"concurrency": concurrency, "summary": summary.to_json(),
                                   "requests": [r.to_json() for r in records]})
    return result


async def _with_progress(replay: Replay, clock, args: argparse.Namespace, console: Console):
    from rich.live import Live
    run_task = asyncio.ensure_future(replay.run())
    with Live(console=console, refresh_per_second=4, transient=True) as live:
        while not run_task.done():
            live.update(_progress(replay, clock(), args.devices))
            await asyncio.wait([run_task], timeout=0.25)
    return run_task.result()


def _progress(replay: Replay, now: float, devices: int) -> Table:
    from rich.table import Table
    stats, config, elapsed = replay.stats, replay.config, replay.elapsed()
    recent = [r for r in stats.recent if r[0] > now - RATE_WINDOW]
    span = min(RATE_WINDOW, elapsed or 0.0) or 1.0
    itls = sorted(r[2] for r in recent if r[2] is not None)
    p90 = itls[min(len(itls) - 1, int(0.9 * len(itls)))] if itls else math.nan
    lanes = {s: stats.lanes.count(s) for s in dict.fromkeys(stats.lanes)}
    clock_text = "first warm-ups" if elapsed is None else f"{min(elapsed, config.duration):.0f}/{config.duration:.0f} s"
    table = Table.grid()
    table.add_row(f"concurrency {config.concurrency}: {clock_text}; lanes "
                  + ", ".join(f"{n} {s}" for s, n in lanes.items()))
    table.add_row(f"{stats.done} done, {stats.failed} failed, {stats.in_flight} in flight")
    table.add_row(f"last {RATE_WINDOW:.0f} s: {sum(r[1] for r in recent) / span / devices:.0f} tok/s/device, "
                  f"P90 interactivity {1 / p90 if p90 > 0 else math.nan:.1f} tok/s/user")
    return table


def summary_table(s: RunSummary) -> Table:
    from rich.table import Table
    table = Table(title=f"concurrency {s.concurrency}: {'valid' if s.valid else 'INVALID: ' + '; '.join(s.invalid_reasons)}",
                  show_header=False, title_justify="left")
    hit = "n/a" if s.hit_rate is None else f"{s.hit_rate:.1%} ({s.hit_rate_source})"
    if s.server_hit_rate is not None and s.hit_rate_source != "server metrics":
        hit += f"; server counters, warm-ups included: {s.server_hit_rate:.1%}"
    table.add_row("requests", f"{s.completed} of {s.requests} completed (+{s.warmups} warm-ups), T = {s.duration:.1f} s, "
                  f"failures {s.failures or 'none'}, short outputs {s.short_outputs}")
    table.add_row("throughput / device", f"{s.throughput_per_device:.1f} tok/s (input {s.input_throughput_per_device:.1f}, "
                  f"output {s.output_throughput_per_device:.1f}; {s.requests_per_second:.2f} req/s)")
    for name, p in (("TTFT", s.ttft), ("ITL (TPOT)", s.itl), ("E2EL", s.e2el)):
        table.add_row(name, f"P50 {p.p50 * 1000:.1f} ms, P90 {p.p90 * 1000:.1f}, P99 {p.p99 * 1000:.1f}")
    table.add_row("interactivity", f"P90 {s.interactivity_p90:.1f} tok/s/user (P50 {s.interactivity_p50:.1f})")
    table.add_row("prefix hit rate", hit)
    return table


def _finite(value):
    """JSON without NaN (not JSON): missing statistics become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
