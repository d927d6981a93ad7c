"""A request body read within --max-request-body-bytes, and parsed into a request model with the
OpenAI error an invalid one gets.

This file owns the size bound (a 413 as soon as a body is known to be too large: from its
Content-Length, or while it streams in, so an oversized body is never held whole) and the one-line
messages naming each bad field. The fronts (router, proxy) read bodies here too. It must never
check values a model's fields accept (SamplingParams and the handlers do) nor touch the engine.
"""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from rackserve.serve.serving_engine import OpenAIError


async def read_body(raw: Request, limit: int) -> bytes:
    """The request body; raises OpenAIError (413) once it is known to exceed `limit` bytes."""
    too_large = OpenAIError(f"the request body exceeds {limit} bytes (--max-request-body-bytes)",
                            status=413, code="request_too_large")
    declared = raw.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in raw.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


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
