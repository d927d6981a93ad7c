"""The chat template's own tokens in a simulated prompt. A server renders the messages through the
model's chat template (role markers around each message, a default system prompt where the
conversation has none, the assistant's generation prompt), so a served prompt is longer than its
messages' words: SmolLM2's template adds 40 tokens to a one-message random prompt of 1,028
words. The simulator's client counts one token per word; this adds the template's, measured once
from the tokenizer (three probe conversations), as fixed token sequences so that equal template
parts stay equal tokens and the prefix cache shares them as it shares the served ones.

The one text it does tokenize is bench's play marker ("[play 3 of 1f0c9a2bc4]", replay.py), which
opens every prompt's own part: brackets, digits and hex split into ~10-14 tokens where its four words
would count 4, so `marker_ids` encodes it with the server's tokenizer (once a play), as the server does.

It owns the measurement, the marker and the wrapping; it must never tokenize a workload's blocks
(the simulator counts words).
"""
from __future__ import annotations

import functools
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

PROBE_WORDS = 20


@dataclass(frozen=True)
class TemplateTokens:
    default_system: int = 0     # inserted when the conversation opens without a system message
    per_message: int = 0        # role markers around each message
    generation: int = 0         # the assistant's generation prompt (and any BOS)

    def wrap(self, messages: list[dict[str, str]], token: Callable[[str], int],
             words: Callable[[str], Sequence[int]]) -> array:
        """The prompt's token ids: each message's words (`words(text)`) inside the template's
        parts, whose ids `token(name)` gives (the same name, the same id). An array of 4-byte
        ids: a simulated rack holds thousands of 100K-token prompts at once."""
        ids = array("I")
        if self.default_system and (not messages or messages[0]["role"] != "system"):
            ids.extend(token(f"<template system {i}>") for i in range(self.default_system))
        for m in messages:
            ids.extend(token(f"<template {m['role']} {i}>") for i in range(self.per_message))
            ids.extend(words(m["content"]))
        ids.extend(token(f"<template generation {i}>") for i in range(self.generation))
        return ids


@functools.lru_cache(maxsize=4)
def _tokenizer(tokenizer_name: str):
    from rackserve.bench.token_text import load_server_tokenizer
    return load_server_tokenizer(tokenizer_name)


def measure(tokenizer_name: str) -> TemplateTokens:
    """The template's token counts for a tokenizer (a .gguf, an HF directory or an alias)."""
    from rackserve.bench.token_text import vocabulary_from_tokenizer
    tokenizer = _tokenizer(tokenizer_name)
    text = " ".join(vocabulary_from_tokenizer(tokenizer, tokenizer_name, PROBE_WORDS).words[:PROBE_WORDS])

    def length(*roles: str) -> int:
        return len(tokenizer.apply_chat_template([{"role": r, "content": text} for r in roles])) - \
            PROBE_WORDS * len(roles)

    alone, with_system = length("user"), length("system", "user")
    per_message = max(0, round((length("system", "user", "assistant", "user") - with_system) / 2))
    generation = max(0, with_system - 2 * per_message)
    return TemplateTokens(max(0, alone - per_message - generation), per_message, generation)


def template_for(tokenizer_name: str | None) -> TemplateTokens:
    """`--tokenizer`'s template; none (0 tokens) for "none" or a model with no tokenizer here
    (a config-only alias of sim/configs)."""
    if tokenizer_name in (None, "none"):
        return TemplateTokens()
    try:
        return measure(tokenizer_name)
    except (ValueError, FileNotFoundError, OSError):
        return TemplateTokens()


def marker_ids(tokenizer_name: str | None) -> Callable[[str], Sequence[int]] | None:
    """The server's tokens of a short text outside the workload's blocks (bench's play marker), or
    None where `template_for` finds no tokenizer (the marker then counts a token a word)."""
    if tokenizer_name in (None, "none"):
        return None
    try:
        tokenizer = _tokenizer(tokenizer_name)
    except (ValueError, FileNotFoundError, OSError):
        return None
    return functools.lru_cache(maxsize=1024)(lambda text: tuple(tokenizer.encode(text, add_special_tokens=False)))
