"""`rackserve bench kv-pool`: multi-turn sessions whose turns move between instances (turn k of a
session goes to instance k mod N), so a session's earlier turns are on another instance's KV cache:
only a pool shared by the instances (MooncakeStoreConnector) turns them into hits. Reports the
prefix hit rate (cached tokens / prompt tokens, from the servers' usage) and TTFT percentiles;
run it against instances with the pool and against instances without, same flags.

Prompts are token ids drawn from a seeded generator, so both runs send identical requests. This
file measures only; it never starts servers.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

from rackserve.bench.record import write_record
from rackserve.serve.cli import register_subcommand


def sessions(num_sessions: int, turns: int, system_len: int, turn_len: int, vocab: int, seed: int) -> list[list[list[int]]]:
    """Each session's prompt per turn: a shared system prompt, then per turn new user tokens (the
    previous answer is not replayed: it differs between servers only if sampling does)."""
    rng = random.Random(seed)
    system = [rng.randrange(100, vocab) for _ in range(system_len)]
    out = []
    for _ in range(num_sessions):
        prompt, per_turn = list(system), []
        for _ in range(turns):
            prompt = prompt + [rng.randrange(100, vocab) for _ in range(turn_len)]
            per_turn.append(prompt)
        out.append(per_turn)
    return out


async def _one(http, url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, int, int]:
    """(TTFT seconds, prompt tokens, cached tokens) of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start, ttft, usage = time.perf_counter(), None, None
    async with http.post(url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return ttft if ttft is not None else time.perf_counter() - start, usage["prompt_tokens"], cached


async def run(args: argparse.Namespace) -> dict:
    import aiohttp
    urls = [u.rstrip("/") for u in args.url]
    plan = sessions(args.sessions, args.turns, args.system_len, args.turn_len, args.vocab, args.seed)
    rows = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.request_timeout)) as http:
        model = args.model or (await (await http.get(urls[0] + "/v1/models")).json())["data"][0]["id"]

        async def session(index: int, turns: list[list[int]]) -> None:
            for k, prompt in enumerate(turns):
                url = urls[(index + k) % len(urls)]   # every turn moves to the next instance
                ttft, prompt_tokens, cached = await _one(http, url, model, prompt, args.max_tokens)
                rows.append({"session": index, "turn": k, "url": url, "ttft_s": ttft,
                             "prompt_tokens": prompt_tokens, "cached_tokens": cached})

        await asyncio.gather(*(session(i, t) for i, t in enumerate(plan)))
    later = [r for r in rows if r["turn"] > 0]   # the first turn can only hit the system prompt
    ttfts = sorted(r["ttft_s"] for r in later)
    return {"urls": urls, "model": model, "rows": rows,
            "hit_rate": sum(r["cached_tokens"] for r in later) / sum(r["prompt_tokens"] for r in later),
            "ttft_p50_ms": statistics.median(ttfts) * 1e3,
            "ttft_p90_ms": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))] * 1e3}


def _add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", action="append", required=True, help="an instance; repeat (turns rotate)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--sessions", type=int, default=4, help="sessions running at once")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-len", type=int, default=256, help="tokens of the prompt every session shares")
    parser.add_argument("--turn-len", type=int, default=128, help="new tokens per turn")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000, help="token ids are drawn below this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--label", default=None)
    parser.add_argument("--output", help="write the results as JSON here")


@register_subcommand("bench kv-pool", "sessions whose turns move between instances: prefix hit rate and TTFT, "
                     "to compare instances sharing a KV pool with instances that do not", _add_args)
def _bench_kv_pool(args: argparse.Namespace) -> int:
    result = asyncio.run(run(args))
    print(f"{args.label or ''} {len(result['rows'])} requests over {len(result['urls'])} instances: "
          f"hit rate after turn 1 {result['hit_rate']:.1%}, TTFT P50 {result['ttft_p50_ms']:.0f} ms, "
          f"P90 {result['ttft_p90_ms']:.0f} ms")
    if args.output:
        write_record(args.output, result, label=args.label)
    return 0
