"""`rackserve router`: an OpenAI-compatible front (chat and completions, streaming or not) that
sends each request to the worker (instance, DP rank) its policy picks.

For each request it renders the chat template and tokenizes with the instances' tokenizer
(prompts.py), hashes the blocks (router.py) and forwards the body with the prompt's token ids (so
the instance does not tokenize again) and `data_parallel_rank`, the pinned DP rank; with P/D
pools, disagg.py orders the hops. A request that got no token yet (the instance is unreachable,
answers 5xx or 429, or leaves the pool) is retried on the next best instance; a stream that
already started ends with an OpenAI error event and [DONE]; other instance errors (4xx) pass
through as they are; with no instance left the client gets a 503; a client that leaves closes
the connection to its instance, which aborts the request (app.py, the HTTP face, cancels the
forward when the client leaves). This file never picks a worker itself and never touches the
index.
"""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any, AsyncIterator, Awaitable

import aiohttp
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rackserve.engine.tokenizer import Tokenizer, load_tokenizer
from rackserve.router import BOTH, MAX_ANSWER_BYTES
from rackserve.router.body import parse_body, prompt_chars, prompt_messages
from rackserve.router.disagg import forward_disaggregated
from rackserve.router.load import uncached_prefill_blocks
from rackserve.router.policies import RoutingPolicy
from rackserve.router.prompts import render
from rackserve.router.router import Instance, Route, Router
from rackserve.serve.http_server import HEADER_TIMEOUT_S
from rackserve.serve.limits import ServerLimits
from rackserve.serve.request_body import read_within
from rackserve.serve.serving_engine import SSE_DONE, OpenAIError

logger = logging.getLogger(__name__)


class RouterFront:
    def __init__(self, router: Router, tokenizer_path: str | None = None,
                 request_timeout_s: float = 600.0,
                 max_request_body_bytes: int = ServerLimits().max_request_body_bytes,
                 max_answer_bytes: int = MAX_ANSWER_BYTES, header_timeout: float = HEADER_TIMEOUT_S) -> None:
        self.router = router
        self.max_answer_bytes = max_answer_bytes
        # Read by app.py, before forward(): a body past the first gets 413, one later than the second 408.
        self.max_request_body_bytes, self.header_timeout = max_request_body_bytes, header_timeout
        self.tokenizer_path = tokenizer_path
        self.tokenizer: Tokenizer | None = None
        self.request_timeout_s = request_timeout_s
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=request_timeout_s)

    async def start(self) -> None:
        await self.router.start()
        path = self.tokenizer_path or next((i.info["tokenizer"] for i in self.router.healthy), None)
        if path is None:
            raise RuntimeError("no instance answered and no --tokenizer was given")
        self.tokenizer = await asyncio.to_thread(load_tokenizer, path)

    async def forward(self, path: str, raw: bytes) -> Response:
        try:
            body = parse_body(raw)
            max_len = self._check_fits(path, body)
        except OpenAIError as e:
            return error_response(e)
        token_ids, body = await asyncio.to_thread(render, self.tokenizer, path, body, max_len)
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        if self.router.disaggregated:
            return await forward_disaggregated(self, path, body, token_ids, salt)
        return await self.attempt(path, body, token_ids, salt)

    async def attempt(self, path: str, body: dict, token_ids: list[int], salt: str | None,
                      roles: tuple[str, ...] = (BOTH,), policy: RoutingPolicy | None = None,
                      first: Route | None = None) -> Response:
        """The answer of the first worker (with one of `roles`, picked by `policy`, `first` if
        given) that takes the request: one that fails before its first token is left for the next
        best; the last refusal, or a 503, when none is left."""
        hashes = self.router.hashes(token_ids, salt)
        tried: set[str] = set()
        last_error: Response | None = None
        while True:
            decision = first or self.router.route(token_ids, tried, salt, roles, policy)
            first = None
            if decision is None:
                return last_error or error_response(OpenAIError("no instance is available", 503, type="server_error"))
            if tried:
                self.router.metrics.retries.inc()
            worker = decision.worker
            tried.add(worker.url)
            request_id = uuid.uuid4().hex
            block_size = self.router.block_size or 0
            self.router.loads.add(request_id, worker, hashes,
                                  uncached_prefill_blocks(len(token_ids), decision.overlap_blocks, block_size))
            self.router.metrics.routed(worker.url, worker.dp_rank, len(token_ids),
                                       decision.overlap_blocks * block_size, decision.best_overlap_blocks * block_size)
            instance = self.router.instances[worker.url]
            try:
                response = await _unless_gone(instance, self._send(
                    instance, path, {**body, "data_parallel_rank": worker.dp_rank}, request_id))
            except asyncio.CancelledError:   # the client left (build_router_app's respond)
                self.router.loads.finish(request_id)
                raise
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
                self.router.loads.finish(request_id)
                self.router.suspect(instance, f"request failed: {e!r}")
                continue
            if response.status_code >= 500 or response.status_code == 429:   # no token yet: try elsewhere
                self.router.loads.finish(request_id)
                last_error = response
                continue
            return response

    def _check_fits(self, path: str, body: dict) -> int | None:
        """Refuse, as the instances would, a prompt longer than any instance's context can hold,
        before the router's tokenizer spends seconds on it; the longest context (None: unknown)."""
        limits = [i.info["max_model_len"] for i in self.router.healthy if "max_model_len" in i.info]
        if self.tokenizer is None or not limits:
            return None
        try:
            self.tokenizer.check_messages_fit(prompt_messages(path, body), max(limits))
            self.tokenizer.check_fits(prompt_chars(path, body), max(limits))
        except ValueError as e:
            raise OpenAIError(str(e), param="messages" if "chat" in path else "prompt") from None
        return max(limits)

    async def _send(self, instance: Instance, path: str, body: dict, request_id: str) -> Response:
        """The instance's answer; raises on a connection that fails before the first token."""
        session, url = self.router.session, instance.url
        resp = await session.post(f"{url}{path}", json=body, timeout=self.timeout)
        try:
            if resp.status != 200 or not body.get("stream"):
                data = await read_within(resp.content.iter_chunked(1 << 20), self.max_answer_bytes,
                                         self.request_timeout_s, resp.content_length)
                self.router.loads.finish(request_id)
                if data is None:
                    resp.close()
                    return error_response(OpenAIError(f"the instance's answer ran past --max-answer-bytes "
                                                      f"{self.max_answer_bytes}", 502, type="server_error"))
                if resp.status == 200:
                    self._count_usage(url, data)
                return Response(data, status_code=resp.status, media_type=resp.content_type)
            first = await _read_event(resp)   # raises if the instance dies before its first chunk
        except BaseException:
            resp.close()   # not back to the pool half-read: the instance sees the disconnect and aborts
            raise
        self.router.loads.first_token(request_id)
        return StreamingResponse(self._stream(instance, resp, first, request_id), media_type="text/event-stream")

    async def _stream(self, instance: Instance, resp: aiohttp.ClientResponse, first: bytes,
                      request_id: str) -> AsyncIterator[bytes]:
        url, ended, output_tokens = instance.url, False, None
        try:
            yield first
            while True:
                event = await _unless_gone(instance, _read_event(resp))
                if not event:
                    ended = True
                    break
                if b'"usage"' in event:
                    tokens = self._count_usage(url, event.split(b"data:", 1)[-1]).get("completion_tokens")
                    output_tokens = tokens if _count(tokens) else None
                yield event
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
            body = OpenAIError(f"the instance failed mid-stream: {e!r}", 502, type="server_error").body()
            yield f"data: {json.dumps(body)}\n\n{SSE_DONE}".encode()
        finally:
            # Read to its end, the connection goes back to the pool; otherwise (the client left
            # mid-stream, the instance failed) it closes, and the instance aborts the request.
            if ended:
                resp.release()
            else:
                resp.close()
            # A stream read whole with its usage is an ITL to learn the instance's prices from.
            self.router.loads.finish(request_id, output_tokens if ended else None)

    def _count_usage(self, url: str, data: bytes) -> dict:
        """The answer's usage (empty if it has none, or not an object), its cached tokens counted
        (when a count). An instance's answer passes through as it is, whatever its usage says."""
        try:
            answer = json.loads(data)
        except (ValueError, RecursionError):
            return {}
        usage = answer.get("usage") if isinstance(answer, dict) else None
        if not isinstance(usage, dict):
            return {}
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if _count(cached):
            self.router.metrics.actual_cached.labels(url).inc(cached)
        return usage


def _count(value: Any) -> bool:
    """Whether `value` is a token count (an int, not a bool, not negative)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


async def _unless_gone(instance: Instance, work: Awaitable[Any]) -> Any:
    """`work`'s result, or ConnectionError (work cancelled) once the instance leaves the pool."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(instance.gone.wait())
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})   # let it unwind (release its connection)
    if task.cancelled():
        raise ConnectionError(f"{instance.url} left the pool")
    return task.result()


async def _read_event(resp: aiohttp.ClientResponse) -> bytes:
    """One SSE event (its lines through the blank line); b"" at the end of the stream."""
    lines = []
    while True:
        line = await resp.content.readline()
        if not line:
            if lines:
                raise ConnectionError("the stream ended inside an event")
            return b""
        lines.append(line)
        if line in (b"\n", b"\r\n"):
            return b"".join(lines)


def error_response(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)
