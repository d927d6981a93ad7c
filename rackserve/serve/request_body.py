"""A request body read within --max-request-body-bytes and on time, and parsed into a request
model with the OpenAI error an invalid one gets.

This file owns the one bounded read (`read_within`: a size cap, known as soon as a body is too
large, from its Content-Length or while it streams in, so it is never held whole; and a time
limit) that every body and answer read from a peer goes through: the server's and the fronts'
request bodies (413 past the size, 408 when late), the fronts' reads of an instance's answers.
And the one-line messages naming each bad field. It must never check values a model's fields
accept (SamplingParams and the handlers do) nor touch the engine.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterable

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from rackserve.serve.serving_engine import OpenAIError


async def read_within(chunks: AsyncIterable[bytes], max_bytes: int, seconds: float | None = None,
                      declared: int | None = None) -> bytes | None:
    """`chunks` joined, or None as soon as they are known to pass `max_bytes` (from `declared`, a
    Content-Length, or while they arrive: read no further); raises TimeoutError when they take
    longer than `seconds` (None: no limit). The caller closes what it read from."""
    if declared is not None and declared > max_bytes:
        return None

    async def join() -> bytes | None:
        parts, size = [], 0
        async for chunk in chunks:
            size += len(chunk)
            if size > max_bytes:
                return None
            parts.append(chunk)
        return b"".join(parts)

    try:   # wait_for, not asyncio.timeout: Python 3.10 has only the former (and its own TimeoutError)
        return await asyncio.wait_for(join(), seconds)
    except asyncio.TimeoutError:
        raise TimeoutError(f"not read whole within {seconds} s") from None


def declared_length(content_length: str | None) -> int | None:
    """A Content-Length header's byte count, for read_within (None: absent or not a count)."""
    return int(content_length) if content_length is not None and content_length.isdigit() else None


async def read_body(raw: Request, limit: int, seconds: float | None = None) -> bytes:
    """The request body; raises OpenAIError 413 once it is known to exceed `limit` bytes, 408
    when it takes longer than `seconds` (--header-timeout, counted from here)."""
    try:
        body = await read_within(raw.stream(), limit, seconds, declared_length(raw.headers.get("content-length")))
    except TimeoutError:
        raise OpenAIError(f"the request body did not arrive within {seconds:g} s (--header-timeout)",
                          status=408, code="request_timeout") from None
    if body is None:
        raise OpenAIError(f"the request body exceeds {limit} bytes (--max-request-body-bytes)",
                          status=413, code="request_too_large")
    return body


def parse_request(model: type[BaseModel], body: bytes, context: dict | None = None) -> Any:
    """`body` as a `model` (`context`: the validation context, e.g. max_messages); raises
    OpenAIError (400) naming what is wrong."""
    try:
        return model.model_validate_json(body, context=context)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        raise OpenAIError(_describe(errors), param=_param(errors[0])) from None


def _param(error: dict) -> str | None:
    loc = [str(part) for part in error["loc"]]
    return loc[0] if loc else None


def _describe(errors: list[dict]) -> str:
    """One line naming each bad field, what was expected, and what was sent."""
    parts = []
    for error in errors[:4]:
        if error["type"] == "json_invalid":
            return f"the request body is not valid JSON: {error['ctx']['error']}"
        where = ".".join(str(part) for part in error["loc"])
        if error["type"] == "missing":
            parts.append(f"'{where}' is required")
        elif not where:
            parts.append(f"the request body: {error['msg']}")
        else:
            parts.append(f"'{where}': {error['msg']} (got {_preview(error['input'])})")
    more = f" (and {len(errors) - 4} more)" if len(errors) > 4 else ""
    return "invalid request: " + "; ".join(parts) + more


def _preview(value: Any) -> str:
    """At most 80 characters of a value's JSON, without writing out a whole list of 424k items."""
    if isinstance(value, list) and len(value) > 80:
        value = value[:80]
    return json.dumps(value)[:80]
