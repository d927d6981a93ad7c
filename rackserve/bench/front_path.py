"""The serving front path's cost per request, measured against a running server: what a request
spends outside the engine's own time to first token (HTTP and JSON in, the chat template, the
tokenizer, validation, and the first token's SSE chunk back to the client).

The server's `time_to_first_token_seconds` histogram starts at the request's arrival in the engine
(LLMEngine.prepare: after the template and the tokenizer) and ends when the engine emits the first
token; the client's TTFT starts when it sends and ends at the first chunk with text. One request at
a time, on an otherwise idle server, the difference is that request's front path. Prompts of
several lengths (bench's one-word-per-token text, each prompt new) give it as a + b x prompt tokens
by least squares: `rackserve sim` prices it per request on the `cpu` device (sim/calibrate.py
--front-path). This file owns that probe; it must never fit step times nor start a server.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
from collections.abc import Sequence

import aiohttp

from rackserve.bench.client import ChatClient, api_root, eos_fields, run_clock
from rackserve.bench.metrics import RequestRecord

LENGTHS = (64, 512, 1024, 2048, 4096)      # prompt words (bench renders one token as one word)
REPEATS = 4


async def _server_ttft(http: aiohttp.ClientSession, base_url: str) -> tuple[float, float]:
    """(sum, count) of the server's time_to_first_token_seconds histogram so far."""
    async with http.get(api_root(base_url) + "/metrics") as response:
        text = await response.text()
    found = {}
    for line in text.splitlines():
        match = re.match(r"[\w:]+time_to_first_token_seconds_(sum|count)(?:\{[^}]*\})?\s+(\S+)", line)
        if match:
            found[match[1]] = found.get(match[1], 0.0) + float(match[2])
    if set(found) != {"sum", "count"}:
        raise ValueError(f"{base_url}/metrics has no time_to_first_token_seconds histogram")
    return found["sum"], found["count"]


def _prompt(words: int, index: int, vocabulary: Sequence[str]) -> str:
    # A new prompt each time (its first words differ), so no request reuses another's prefix.
    rest = [vocabulary[(index * 7919 + i * 31) % len(vocabulary)] for i in range(words - 1)]
    return " ".join([f"probe{index}", *rest])


async def probe(base_url: str, model: str, vocabulary: Sequence[str], lengths: Sequence[int] = LENGTHS,
                repeats: int = REPEATS, fields: dict | None = None) -> list[dict]:
    """One point per request: prompt tokens, client TTFT, the server's TTFT, their difference.
    `fields`: more request fields (a logit bias)."""
    points = []
    # Special tokens' text too: under ignore_eos a model may answer <|im_end|> twice (SmolLM2 does
    # on some probes), which streams no text without it, and the client then has no first chunk.
    fields = {**eos_fields("ignore_eos"), "skip_special_tokens": False, **(fields or {})}
    async with aiohttp.ClientSession() as http:
        client = ChatClient(base_url, model, http, run_clock(), 600.0, fields)
        await client.send([{"role": "user", "content": _prompt(16, -1, vocabulary)}],
                          RequestRecord(0, 0, "warmup", 0, "warmup", 16, 2, 0.0))     # first-request costs
        for index in range(repeats * len(lengths)):
            words = lengths[index % len(lengths)]
            before = await _server_ttft(http, base_url)
            record = await client.send([{"role": "user", "content": _prompt(words, index, vocabulary)}],
                                       RequestRecord(0, index, "probe", 0, "main", words, 2, 0.0))
            after = await _server_ttft(http, base_url)
            if not record.ok or after[1] - before[1] != 1:
                raise ValueError(f"request {index} failed or was not alone on the server: {record.error_message}")
            if record.first_chunk is None:     # tokens whose text is empty even so (a partial UTF-8 character)
                raise ValueError(f"request {index} streamed no text: its first token has no client TTFT")
            client_ttft, server_ttft = record.first_chunk - record.start, after[0] - before[0]
            points.append({"words": words, "prompt_tokens": record.prompt_tokens, "client_ttft_s": client_ttft,
                           "server_ttft_s": server_ttft, "front_s": client_ttft - server_ttft})
    return points


def fit(points: Sequence[dict]) -> tuple[float, float]:
    """(a, b) of front = a + b x prompt tokens, least squares over each prompt length's medians (the
    threads of a loaded machine stretch a few requests' front path many times), both kept >= 0."""
    lengths = sorted({p["words"] for p in points})
    groups = [[p for p in points if p["words"] == n] for n in lengths]
    xs = [statistics.median(p["prompt_tokens"] for p in g) for g in groups]
    ys = [statistics.median(p["front_s"] for p in g) for g in groups]
    if len(xs) < 2:
        return max(0.0, ys[0]), 0.0
    mx, my = statistics.mean(xs), statistics.mean(ys)
    b = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs))
    return max(0.0, my - b * mx), b


def main(argv: Sequence[str] | None = None) -> int:
    from rackserve.bench.record import cpu_name
    from rackserve.bench.token_text import load_server_tokenizer, vocabulary_from_tokenizer
    parser = argparse.ArgumentParser(description="measure a server's front path per request (see the docstring)")
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", default=None, help="default: the server's only model")
    parser.add_argument("--tokenizer", required=True, help="the server's tokenizer (for its vocabulary's words)")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    from rackserve.bench.client import served_models
    vocabulary = vocabulary_from_tokenizer(load_server_tokenizer(args.tokenizer), args.tokenizer).words

    async def run() -> list[dict]:
        async with aiohttp.ClientSession() as http:
            model = args.model or next(iter(await served_models(http, args.base_url)))
        return await probe(args.base_url, model, vocabulary, repeats=args.repeats)

    load = [os.getloadavg()[0]]
    points = asyncio.run(run())
    load.append(os.getloadavg()[0])
    a, b = fit(points)
    for n in LENGTHS:
        mine = [p["front_s"] for p in points if p["words"] == n]
        print(f"{n:5d} words: front path median {statistics.median(mine) * 1e3:6.1f} ms")
    print(f"front path: {a * 1e3:.2f} ms a request + {b * 1e6:.2f} us a prompt token "
          f"(load {load[0]:.1f} -> {load[1]:.1f})")
    if args.output:
        with open(args.output, "w") as f:
            command = ["python", "-m", "rackserve.bench.front_path", *(argv if argv is not None else sys.argv[1:])]
            json.dump({"bench": "front_path", "request_seconds": a, "prompt_token_seconds": b, "points": points,
                       "load_average": load, "cpu": cpu_name(), "command": command}, f, indent=1)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
