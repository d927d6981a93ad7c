"""The benchmark's side of the wire: streaming chat completions against any OpenAI-compatible
server, timed chunk by chunk, plus the server facts a run needs (model name, context length,
prefix-cache counters from /metrics).

One request is POST /v1/chat/completions with stream=true, stream_options.include_usage,
max_tokens, and what keeps the server from stopping at end-of-sequence: `ignore_eos` (vLLM's,
llama.cpp's and rackserve's extra field) or a -100 `logit_bias` on the EOS tokens (OpenAI's own
field, for servers that refuse unknown fields). The record keeps its start, the first chunk
carrying text (TTFT), every such chunk, the end, and the server's usage.

This file owns the HTTP calls and failure kinds. It must never decide what to send (replay.py
does) nor compute statistics (metrics.py does).
"""
from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable

import aiohttp

from rackserve.bench.metrics import CONTEXT_OVERFLOW, RequestRecord

# What servers say when a prompt does not fit: vLLM and rackserve ("maximum context length"),
# llama.cpp ("exceeds the available context size"), OpenAI ("context_length_exceeded").
_OVERFLOW = re.compile(r"context length|context size|context_length|context window|too long", re.I)


def api_root(base_url: str) -> str:
    """The server root, whether or not the user wrote the /v1."""
    url = base_url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def eos_fields(how: str, eos_token_ids: frozenset[int] = frozenset()) -> dict:
    """Request fields asking for exactly max_tokens tokens: `how` is ignore_eos, logit_bias (needs
    the EOS ids) or allow (nothing: the server may stop early; such outputs are counted short)."""
    if how == "ignore_eos":
        return {"ignore_eos": True}
    if how == "logit_bias":
        assert eos_token_ids, "a logit bias on EOS needs the tokenizer's EOS ids"
        return {"logit_bias": {str(i): -100.0 for i in sorted(eos_token_ids)}}
    assert how == "allow", f"unknown EOS handling {how!r}"
    return {}


class ChatClient:
    def __init__(self, base_url: str, model: str, http: aiohttp.ClientSession,
                 clock: Callable[[], float], request_timeout: float, extra_fields: dict):
        self.url = api_root(base_url) + "/v1/chat/completions"
        self.model = model
        self.extra_fields = extra_fields
        self.http = http
        self.clock = clock                  # seconds since the run began
        self.timeout = aiohttp.ClientTimeout(total=request_timeout)

    async def send(self, messages: list[dict[str, str]], record: RequestRecord) -> RequestRecord:
        """Streams one completion of `record.max_tokens` tokens, filling `record` in."""
        body = {"model": self.model, "messages": messages, "max_tokens": record.max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, **self.extra_fields}
        record.start = self.clock()
        try:
            async with self.http.post(self.url, json=body, timeout=self.timeout) as response:
                if response.status != 200:
                    text = await response.text()
                    record.error = _http_failure(response.status, text)
                    record.error_message = text[:500]
                else:
                    await self._read_stream(response, record)
        except asyncio.TimeoutError:
            record.error, record.error_message = "timeout", f"no answer within {self.timeout.total} s"
        except aiohttp.ClientError as e:
            record.error, record.error_message = "connection", f"{type(e).__name__}: {e}"
        record.end = self.clock()
        return record

    async def _read_stream(self, response: aiohttp.ClientResponse, record: RequestRecord) -> None:
        done = False    # [DONE], or a finish reason (some servers, like transformers serve, send no [DONE])
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError:
                record.error, record.error_message = "bad_chunk", data[:500].decode(errors="replace")
                return
            if "error" in chunk:
                error = chunk["error"]
                record.error = "stream_error"
                record.error_message = str(error.get("message", error) if isinstance(error, dict) else error)[:500]
                return
            choices = chunk.get("choices") or ()
            done = done or any(choice.get("finish_reason") for choice in choices)
            if any(_delta_text(choice) for choice in choices):
                now = self.clock()
                if record.first_chunk is None:
                    record.first_chunk = now
                record.chunk_times.append(now)
            usage = chunk.get("usage")
            if usage:
                record.prompt_tokens = usage.get("prompt_tokens")
                record.output_tokens = usage.get("completion_tokens")
                details = usage.get("prompt_tokens_details") or {}
                record.cached_tokens = details.get("cached_tokens", record.cached_tokens)
            if record.cached_tokens is None and "cache_n" in (chunk.get("timings") or {}):
                # llama.cpp's server reports the prompt tokens it reused in its timings.
                record.cached_tokens = chunk["timings"]["cache_n"]
        if not done:
            record.error, record.error_message = "stream_cut", "the stream ended before a finish reason or [DONE]"
        elif record.output_tokens is None:
            # A server that sends no usage: each chunk is taken as one token.
            record.output_tokens = len(record.chunk_times)
        if not record.error and not record.output_tokens:
            record.error, record.error_message = "empty", "no output tokens"


def _delta_text(choice: dict) -> str:
    delta = choice.get("delta") or {}
    return (delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
            or choice.get("text") or "")


def _http_failure(status: int, text: str) -> str:
    if status in (400, 413, 422) and _OVERFLOW.search(text):
        return CONTEXT_OVERFLOW
    return f"http_{status}"


# ---- server facts ------------------------------------------------------------------------------


async def served_models(http: aiohttp.ClientSession, base_url: str) -> dict[str, int | None]:
    """The models the server lists, each with its context length when the server reports one
    (vLLM and rackserve put max_model_len in /v1/models)."""
    async with http.get(api_root(base_url) + "/v1/models") as response:
        response.raise_for_status()
        cards = (await response.json())["data"]
    return {card["id"]: card.get("max_model_len") for card in cards}


async def prefix_cache_counters(http: aiohttp.ClientSession, base_url: str) -> tuple[float, float] | None:
    """(hit tokens, queried tokens) so far from a vLLM-style /metrics page
    (`*:prefix_cache_hits_total`, `*:prefix_cache_queries_total`), or None without them."""
    try:
        async with http.get(api_root(base_url) + "/metrics") as response:
            if response.status != 200:
                return None
            text = await response.text()
    except aiohttp.ClientError:
        return None
    totals = {"hits": 0.0, "queries": 0.0}
    found = set()
    for line in text.splitlines():
        match = re.match(r"[\w:]+:prefix_cache_(hits|queries)_total(?:\{[^}]*\})?\s+(\S+)", line)
        if match:
            totals[match[1]] += float(match[2])
            found.add(match[1])
    return (totals["hits"], totals["queries"]) if found == {"hits", "queries"} else None


def run_clock() -> Callable[[], float]:
    start = time.perf_counter()
    return lambda: time.perf_counter() - start
