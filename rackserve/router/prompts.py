"""Tokenize once: the router renders and tokenizes each request's prompt (it needs the token ids
to hash its blocks) and forwards those ids, so the instance does not tokenize again.

- /v1/completions: each text prompt becomes its token ids (OpenAI's API takes token-id prompts;
  the answer does not change, as no field of a completion echoes the prompt's text).
- /v1/chat/completions: the body keeps its messages and gains `prompt_token_ids`, the rendered
  conversation's ids (rackserve's extension; the instance then skips its chat template). The
  instance still writes the whole chat answer, so it is the same as a direct call's.

A body the router cannot read is forwarded as it came: refusing it, in its own words, is the
instance's (a prompt too long for any tokenization was refused before, by body.py's bound). This
file never sends anything and never hashes.
"""
from __future__ import annotations

from typing import NamedTuple

from rackserve.engine.tokenizer import Tokenizer
from rackserve.serve.protocol import ChatCompletionRequest, CompletionRequest


class Rendered(NamedTuple):
    token_ids: list[int]      # the first prompt's ids, to hash ([] when unknown)
    body: dict                # what to forward


def render(tokenizer: Tokenizer | None, path: str, body: dict, max_len: int | None = None) -> Rendered:
    """`max_len`: the instances' longest context; a conversation whose rendered text cannot fit
    it is forwarded untokenized (Tokenizer.apply_chat_template's bound)."""
    if tokenizer is None:
        return Rendered([], body)
    try:
        if path.endswith("chat/completions"):
            request = ChatCompletionRequest.model_validate(body)
            ids = request.prompt_token_ids or tokenizer.apply_chat_template(request.chat_messages(),
                                                                            max_len=max_len)
            return Rendered(ids, {**body, "prompt_token_ids": ids})
        prompts = CompletionRequest.model_validate(body).prompts()
        ids = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    except Exception:   # noqa: BLE001 - any refusal is the instance's to word
        return Rendered([], body)
    if not all(ids):   # an empty prompt: the instance refuses it as it would the text
        return Rendered(ids[0], body)
    return Rendered(ids[0], {**body, "prompt": ids[0] if len(ids) == 1 else ids})
