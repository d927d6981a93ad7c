"""The front door shared by `rackserve router` and `rackserve proxy`: the request body read
strictly, and prompts measured before anything tokenizes them.

A front forwards what it reads, so what it cannot re-send (NaN, Infinity, invalid UTF-8, a body
nested past the parser's depth, anything but a JSON object) is refused here with the OpenAI
error an instance would give, instead of failing inside the front (a 500) or reaching an
instance. A prompt that cannot fit the instances' context is refused before the router's
tokenizer spends seconds on it. This file never routes and never talks to an instance.
"""
from __future__ import annotations

import json
from typing import Any

from rackserve.serve.serving_engine import OpenAIError


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_body(raw: bytes) -> dict[str, Any]:
    """The body as a dict; raises OpenAIError (400) when it is not a standard JSON object."""
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError as e:
        raise OpenAIError(f"the request body is not valid UTF-8: {e.reason}") from None
    except ValueError as e:
        raise OpenAIError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise OpenAIError("the request body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    return body


def prompt_messages(path: str, body: dict[str, Any]) -> int:
    """Messages in a chat body (Tokenizer.check_messages_fit bounds them before rendering); 0 else."""
    messages = body.get("messages") if path.endswith("chat/completions") else None
    return len(messages) if isinstance(messages, list) else 0


def prompt_chars(path: str, body: dict[str, Any]) -> int:
    """Characters of text the prompt(s) hold, as the instances bound them before tokenizing
    (Tokenizer.check_fits): message contents for chat, the text prompts for completions."""
    if path.endswith("chat/completions"):
        messages = body.get("messages")
        items = [m.get("content") for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
    else:
        prompt = body.get("prompt")
        items = prompt if isinstance(prompt, list) else [prompt]
    return sum(len(item) for item in items if isinstance(item, str))
