"""What the completions and chat handlers share: the error type that becomes an OpenAI error body,
starting the engine requests behind one HTTP request (request_streams.py), SSE framing, and
logprob helpers.

This file owns the rule that an HTTP request fails as a whole, with a 400, before any byte is
sent when the engine rejects one of its prompts, and that every engine request it started is
aborted when the HTTP request ends early. It must never sample, tokenize prompts for the engine
or shape OpenAI response bodies (the handlers do).
"""
from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Awaitable, TypeVar

from pydantic import BaseModel
from starlette.requests import Request

from rackserve.outputs import CompletionOutput, Logprob, RequestOutput
from rackserve.sampling_params import SamplingParams
from rackserve.serve.limits import ServerLimits, check_limits, check_logprob_entries
from rackserve.serve.protocol import (ErrorInfo, ErrorResponse, PromptTokensDetails, SamplingRequest,
                                      UsageInfo)
from rackserve.serve.request_streams import RequestStreams, UnreadStreamError

if TYPE_CHECKING:
    from rackserve.engine.async_engine import AsyncEngine
    from rackserve.engine.tokenizer import Tokenizer

SSE_DONE = "data: [DONE]\n\n"
CLIENT_CLOSED_REQUEST = 499             # nginx's status for "the client went away first"
R = TypeVar("R")
MIN_LOGPROB = -9999.0                   # JSON has no -inf; OpenAI clients get this floor instead


class OpenAIError(Exception):
    """A request the server refuses; rendered as {"error": {message, type, param, code}}."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, status, param, code, type

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()


# U+2028, U+2029 and NEL are line breaks to str.splitlines and to clients that read a stream that way
# (httpx's aiter_lines): model_dump_json writes them raw inside strings, which cut an event in two for
# those clients (a tiny model's text did, in the flood test). Escaped, as JSON allows, an event is one line.
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def sse(chunk: BaseModel | dict) -> str:
    data = chunk.model_dump_json() if isinstance(chunk, BaseModel) else json.dumps(chunk)
    return f"data: {data.translate(_LINE_BREAKS)}\n\n"


def splice_json(text: str | bytes, key: str, raw: bytes | list[bytes],
                placeholder: bytes = b"null") -> bytes:
    """`text` (pydantic's JSON of a model whose field `key` holds `placeholder`) with that value
    replaced by `raw`, JSON text built apart (a list: the array of those items). pydantic escapes
    every quote inside a string, so the first `"key":placeholder` is that field while only strings
    and numbers come before it (a free-form dict after it, kv_transfer_params, may hold anything).
    A large answer is serialized in pieces this way: one model_dump_json of ~100 MB holds the GIL
    for seconds."""
    text = text.encode() if isinstance(text, str) else text
    field = b'"' + key.encode() + b'":'
    head, found, tail = text.partition(field + placeholder)
    assert found, (key, text[:200])
    if isinstance(raw, list):
        items = [b","] * (2 * len(raw) - 1)
        items[::2] = raw
        return b"".join((head, field, b"[", *items, b"]", tail))   # one copy (~100 MB at the bound)
    return b"".join((head, field, raw, tail))


def clamp_logprob(value: float) -> float:
    return MIN_LOGPROB if math.isinf(value) or value < MIN_LOGPROB else value


def stream_error(e: Exception) -> str:
    """The error event ending a stream whose 200 is already sent (reported in-band, as OpenAI does)."""
    if isinstance(e, UnreadStreamError):
        return sse(OpenAIError(str(e), param="stream", code="stream_not_read").body())
    return sse(OpenAIError(f"generation failed: {e}", status=500, type="server_error").body())


@dataclass
class ChoiceState:
    """One choice's text so far (non-streaming) and where its next streamed token starts."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_offset: int = 0
    opened: bool = False                # a streamed chunk of this choice was sent

    def add(self, delta: CompletionOutput) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


@dataclass
class UsageCounter:
    """Token counts of one HTTP request across its prompts and samples."""
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)
    completion_tokens: int = 0

    def add(self, prompt_index: int, out: RequestOutput) -> None:
        self.prompt_tokens[prompt_index] = len(out.prompt_token_ids)
        cached = max(self.cached_tokens.get(prompt_index, 0), out.num_cached_tokens)
        self.cached_tokens[prompt_index] = cached
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)

    def info(self) -> UsageInfo:
        prompt = sum(self.prompt_tokens.values())
        return UsageInfo(prompt_tokens=prompt, completion_tokens=self.completion_tokens,
                         total_tokens=prompt + self.completion_tokens,
                         prompt_tokens_details=PromptTokensDetails(
                             cached_tokens=sum(self.cached_tokens.values())))


def token_text(tokenizer: Tokenizer | None, token_id: int, logprob: Logprob | None) -> str:
    """A token's text; without a tokenizer (skip_tokenizer_init) "token_id:N", as vLLM writes it."""
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.token_text(token_id) if tokenizer else f"token_id:{token_id}"


def top_by_rank(step: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely tokens of one step; the sampled token is only among them by rank."""
    return sorted(step.items(), key=lambda kv: kv[1].rank)[:k]


async def wait_for_disconnect(request: Request) -> None:
    """Returns once the client of a request whose body was already read goes away."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_client_leaves(request: Request, work: Awaitable[R]) -> R | None:
    """`work`'s result, or None once the client of `request` (its body already read) goes away
    first: then `work` is cancelled and awaited while it unwinds, so what it opened (a
    connection to an instance, which then aborts the request there) is closed before this returns.
    For fronts whose work never returns None (a Response)."""
    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    return None if task.cancelled() else task.result()


class OpenAIServing:
    """Checks common to both endpoints, and starting the engine requests of one HTTP request."""

    def __init__(self, engine: AsyncEngine, model_name: str, limits: ServerLimits | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.limits = limits or ServerLimits()

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(f"The model `{model}` does not exist; this server serves "
                              f"`{self.model_name}` (see /v1/models)", status=404, param="model",
                              code="model_not_found")

    def check_request(self, request: SamplingRequest, num_prompts: int, logprobs: int | None,
                      best_of: int | None = None) -> None:
        self.check_model(request.model)
        exceeded = check_limits(self.limits, n=request.n, best_of=best_of, num_prompts=num_prompts,
                                logprobs=logprobs, stop=request.stop, stop_token_ids=request.stop_token_ids,
                                logit_bias=request.logit_bias)
        if exceeded is not None:
            raise OpenAIError(exceeded[0], param=exceeded[1])
        unsupported = request.unsupported()
        if unsupported:
            raise OpenAIError(f"`{unsupported}` is not supported here with this value; remove it "
                              "from the request", param=unsupported)

    def check_held_logprobs(self, params: SamplingParams, prompts: list[str | list[int]], stream: bool) -> None:
        """Refuses a non-streaming request whose logprobs could outgrow --max-logprob-entries. A
        text prompt counts as one token: its length is the engine's to find, and the bound is an
        upper one."""
        if stream or params.logprobs is None:
            return
        shortest = min(len(p) if isinstance(p, list) else 1 for p in prompts)
        room = max(self.engine.config.model.max_model_len - shortest, 0)
        most = room if params.max_tokens is None else min(params.max_tokens, room)
        message = check_logprob_entries(self.limits, num_sequences=len(prompts) * params.n,
                                        max_tokens=most, logprobs=params.logprobs)
        if message is not None:
            raise OpenAIError(message, param="logprobs")

    @staticmethod
    def sampling_params(request: SamplingRequest, max_tokens: int | None,
                        logprobs: int | None) -> SamplingParams:
        try:
            return request.sampling_params(max_tokens, logprobs)
        except ValueError as e:
            raise OpenAIError(str(e)) from None

    async def start(self, prompts: list[str | list[int]], params: SamplingParams,
                    request_id: str, cache_salt: str | None = None,
                    data_parallel_rank: int | None = None) -> RequestStreams:
        streams = RequestStreams(self.engine, prompts, params, request_id, cache_salt, data_parallel_rank,
                                 max_unread_entries=self.limits.max_logprob_entries)
        try:
            await streams.start()
        except BaseException as e:  # includes the handler's cancellation on client disconnect
            streams.abort()
            if isinstance(e, ValueError):
                raise OpenAIError(str(e)) from None
            raise
        return streams
