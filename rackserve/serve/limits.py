"""ServerLimits: the bounds one HTTP request must stay within, so that no single request can take
the server's memory or time (each is a `rackserve serve` flag), and the checks that apply them.

This file owns those bounds and their messages. The values' own validity (finite, in range) is
SamplingParams'; whether a prompt fits the context is the engine's. It must never touch the engine.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from rackserve.config import _opt, add_dataclass_cli_args


@dataclass(frozen=True)
class ServerLimits:
    max_request_body_bytes: int = _opt(16 * 2**20, "largest request body, bytes; larger ones get 413")
    max_n: int = _opt(128, "most samples (n, best_of) one request may ask for (OpenAI's bound)")
    max_prompts_per_request: int = _opt(128, "most prompts in one /v1/completions request")
    max_logprobs: int = _opt(20, "most top logprobs a request may ask for (vLLM's --max-logprobs)")
    max_logprob_entries: int = _opt(2**20, "most logprob entries a non-streaming response may hold: "
                                    "prompts x n x max_tokens x (logprobs + 1); stream past it")
    max_stop_strings: int = _opt(16, "most stop strings in one request")
    max_stop_str_len: int = _opt(1024, "longest stop string, characters")
    max_stop_token_ids: int = _opt(1024, "most stop_token_ids in one request")
    max_logit_bias: int = _opt(1024, "most logit_bias entries in one request")
    max_waiting_requests: int = _opt(1024, "most sequences waiting for their first token; past it a "
                                     "request gets 429 with Retry-After instead of queueing")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        return add_dataclass_cli_args(cls, parser)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "ServerLimits":
        limits = cls(**{f.name: getattr(ns, f.name) for f in fields(cls)})
        bad = [f.name for f in fields(cls) if getattr(limits, f.name) < 1]
        if bad:
            raise ValueError(f"{', '.join(bad)} must be at least 1")
        return limits


def check_limits(limits: ServerLimits, *, n: int | None, best_of: int | None, num_prompts: int,
                 logprobs: int | None, stop: str | list[str] | None, stop_token_ids: list[int] | None,
                 logit_bias: dict | None) -> tuple[str, str] | None:
    """(message, param) naming the first bound a request exceeds, or None."""
    if n is not None and not 1 <= n <= limits.max_n:
        return f"n must be in [1, {limits.max_n}], got {n}", "n"
    if best_of is not None and not max(1, n or 1) <= best_of <= limits.max_n:
        return f"best_of must be in [n, {limits.max_n}], got {best_of}", "best_of"
    if num_prompts > limits.max_prompts_per_request:
        return (f"at most {limits.max_prompts_per_request} prompts per request, got {num_prompts}; "
                "split the batch"), "prompt"
    if logprobs is not None and logprobs > limits.max_logprobs:
        return f"at most {limits.max_logprobs} logprobs, got {logprobs}", "logprobs"
    stops = [stop] if isinstance(stop, str) else stop or []
    if len(stops) > limits.max_stop_strings:
        return f"at most {limits.max_stop_strings} stop strings, got {len(stops)}", "stop"
    if any(len(s) > limits.max_stop_str_len for s in stops):
        return f"stop strings must be at most {limits.max_stop_str_len} characters", "stop"
    if stop_token_ids is not None and len(stop_token_ids) > limits.max_stop_token_ids:
        return f"at most {limits.max_stop_token_ids} stop_token_ids, got {len(stop_token_ids)}", "stop_token_ids"
    if logit_bias is not None and len(logit_bias) > limits.max_logit_bias:
        return f"at most {limits.max_logit_bias} logit_bias entries, got {len(logit_bias)}", "logit_bias"
    return None


def check_logprob_entries(limits: ServerLimits, *, num_sequences: int, max_tokens: int,
                          logprobs: int | None) -> str | None:
    """The message refusing a non-streaming request whose logprobs could outgrow the bound, or None.

    Such a response is held whole and serialized at once: prompts x n x max_tokens x (logprobs + 1)
    entries (128 x 8,192 x 21 is 22M, gigabytes of Python objects). A stream holds one step's.
    `max_tokens` is the most the request can generate (its own bound, or what the context leaves).
    """
    if logprobs is None:
        return None
    entries = num_sequences * max_tokens * (logprobs + 1)
    if entries <= limits.max_logprob_entries:
        return None
    return (f"this request could return {entries} logprob entries ({num_sequences} sequences x "
            f"{max_tokens} tokens x {logprobs + 1} logprobs each), more than a non-streaming response "
            f"may hold ({limits.max_logprob_entries}, --max-logprob-entries); lower n, max_tokens or "
            "the number of logprobs, or set stream=true")
