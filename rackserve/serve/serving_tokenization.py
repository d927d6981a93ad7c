"""/tokenize and /detokenize in vLLM's shapes: a prompt or chat messages -> token ids (with their
count and the context length), token ids -> text. Clients use them to count and budget tokens
exactly as the server will.

This file owns those request and response bodies and their handlers. It must never start engine
requests; tokenizing runs in a worker thread so a long text does not stall the event loop.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Annotated

from pydantic import field_validator

from rackserve.engine.tokenizer import PromptTooLongError
from rackserve.serve.protocol import FAIL_FAST, ChatMessage, Ids, OpenAIBaseModel, at_most_max_messages
from rackserve.serve.serving_engine import OpenAIError, OpenAIServing

if TYPE_CHECKING:
    from rackserve.engine.tokenizer import Tokenizer


class TokenizeRequest(OpenAIBaseModel):
    """vLLM's two tokenize bodies in one: exactly one of `prompt` and `messages`."""
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], FAIL_FAST] | None = None
    # None: vLLM's defaults, True for a prompt and False for messages (the template writes them).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True  # messages only
    return_token_strs: bool = False     # also the tokens' vocabulary strings ("Ġword" in byte-level BPE)

    _bounded = field_validator("messages", mode="before")(at_most_max_messages)


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: Ids


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class OpenAIServingTokenization(OpenAIServing):

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.check_model(request.model)
        tokenizer = self._tokenizer()
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("send exactly one of 'prompt' (text) and 'messages' (a chat)", param="prompt")
        max_len = self.engine.config.model.max_model_len
        try:   # a text no context could hold is refused before it is rendered, tokenized and held whole
            # (the parse bounded the message count: protocol.at_most_max_messages)
            texts = [request.prompt] if request.prompt is not None else [m.text() for m in request.messages]
            tokenizer.check_fits(sum(map(len, texts)), max_len)
        except ValueError as e:
            raise OpenAIError(str(e), param="prompt" if request.prompt is not None else "messages") from None
        if request.prompt is not None:
            special = True if request.add_special_tokens is None else request.add_special_tokens
            ids = await asyncio.to_thread(tokenizer.encode, request.prompt, special)
        else:
            messages = [{"role": m.role, "content": m.text()} for m in request.messages]
            try:
                ids = await asyncio.to_thread(tokenizer.apply_chat_template, messages,
                                              request.add_generation_prompt, bool(request.add_special_tokens),
                                              max_len)
            except PromptTooLongError as e:
                raise OpenAIError(str(e), param="messages") from None
            except Exception as e:  # the template rejects a conversation (e.g. roles out of order)
                raise OpenAIError(f"the chat template could not render these messages: {e}",
                                  param="messages") from None
        strs = tokenizer.hf.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.config.model.max_model_len,
                                tokens=ids, token_strs=strs)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        tokenizer = self._tokenizer()
        max_len = self.engine.config.model.max_model_len
        if len(request.tokens) > max_len:   # as a prompt of ids is bounded, before any work on them
            raise OpenAIError(f"This model's maximum context length is {max_len} tokens; got "
                              f"{len(request.tokens)} tokens to detokenize", param="tokens")
        bad = [t for t in request.tokens if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise OpenAIError(f"token ids must be in [0, {tokenizer.vocab_size}); got {bad[:5]}",
                              param="tokens")
        # Special tokens kept, so that detokenize(tokenize(text)) gives the text back.
        text = await asyncio.to_thread(tokenizer.decode, request.tokens, False)
        return DetokenizeResponse(prompt=text)

    def _tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise OpenAIError("this server runs with --skip-tokenizer-init and has no tokenizer")
        return self.tokenizer
