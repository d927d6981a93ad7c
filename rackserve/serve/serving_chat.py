"""/v1/chat/completions: messages through the tokenizer's chat template, a reply whole or as SSE.

This file owns the chat response shapes (message, delta chunks opening with the assistant role,
logprobs as content[{token, logprob, bytes, top_logprobs}]). It must never validate sampling
values (SamplingParams does) nor decide whether a prompt fits the context (the engine does).
A whole answer is JSON text built in a worker thread, its logprobs a step at a time as plain
dicts: --max-logprob-entries admits ~1M entries, and a pydantic object each on the event loop
held every other client 19-60 s (bench/logprob_shaping.py).
"""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import AsyncIterator

from pydantic_core import to_json

from rackserve.engine.tokenizer import PromptTooLongError
from rackserve.outputs import Logprob
from rackserve.serve.protocol import (ChatCompletionRequest, ChatCompletionResponse,
                                      ChatCompletionResponseChoice, ChatCompletionStreamChoice,
                                      ChatCompletionStreamResponse, ChatLogProbs, ChatResponseMessage,
                                      DeltaMessage)
from rackserve.serve.request_streams import RequestStreams
from rackserve.serve.serving_engine import (SSE_DONE, ChoiceState, OpenAIError, OpenAIServing,
                                            UsageCounter, clamp_logprob, splice_json, sse,
                                            stream_error, token_text, top_by_rank)


class OpenAIServingChat(OpenAIServing):

    async def create_chat_completion(self, request: ChatCompletionRequest, request_id: str | None = None
                                     ) -> bytes | AsyncIterator[str]:
        """The response's JSON (a ChatCompletionResponse), or (stream=True) an iterator of SSE
        events already past the first token.
        `request_id` (the client's X-Request-Id) is the stem of the response's and engine's ids."""
        self.check_request(request, 1, request.top_logprobs)
        if self.tokenizer is None:
            raise OpenAIError("this server runs with --skip-tokenizer-init, so it has no chat template; "
                              "send token ids to /v1/completions", param="messages")
        if not request.messages:
            raise OpenAIError("messages is empty; send at least one message", param="messages")
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
        max_len = self.engine.config.model.max_model_len
        try:   # the context bounds need no rendering (the parse bounded the message count)
            messages = request.chat_messages()
            self.tokenizer.check_fits(sum(len(m["content"]) for m in messages), max_len)
        except ValueError as e:
            raise OpenAIError(str(e), param="messages") from None
        try:   # off the event loop: a long conversation must not stall other connections
            prompt = request.prompt_token_ids or await asyncio.to_thread(
                self.tokenizer.apply_chat_template, messages, max_len=max_len)
        except PromptTooLongError as e:   # its rendered text: refused before it is tokenized
            raise OpenAIError(str(e), param="messages") from None
        except Exception as e:  # the template rejects a conversation (e.g. roles out of order)
            raise OpenAIError(f"the chat template could not render these messages: {e}",
                              param="messages") from None
        max_tokens = request.max_completion_tokens
        if max_tokens is None:
            max_tokens = request.max_tokens
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(request, max_tokens, logprobs)
        self.check_held_logprobs(params, [prompt], request.stream)
        top_k = request.top_logprobs or 0
        request_id = f"chatcmpl-{request_id or uuid.uuid4().hex}"
        streams = await self.start([prompt], params, request_id, request.cache_salt,
                                   request.data_parallel_rank)
        if request.stream:
            return self._stream(request, streams, request_id, params.n, top_k)
        try:
            return await self._collect(streams, request_id, top_k)
        finally:
            streams.abort()

    async def _collect(self, streams: RequestStreams, request_id: str, top_k: int) -> bytes:
        choices: dict[int, ChoiceState] = {}
        usage = UsageCounter()
        kv_transfer_params = None
        async for p, out in streams:
            usage.add(p, out)
            kv_transfer_params = out.kv_transfer_params or kv_transfer_params
            for delta in out.outputs:
                choices.setdefault(delta.index, ChoiceState()).add(delta)
        # Off the event loop: in plain Python the thread yields the GIL every few ms, so other
        # clients are served while ~1M logprob entries are shaped.
        response = ChatCompletionResponse(id=request_id, model=self.model_name, usage=usage.info(),
                                          kv_transfer_params=kv_transfer_params, choices=[])
        return await asyncio.to_thread(self._json, response, sorted(choices.items()), top_k)

    def _json(self, response: ChatCompletionResponse, choices: list[tuple[int, ChoiceState]],
              top_k: int) -> bytes:
        """`response`'s JSON with these choices: what model_dump_json would write, serialized a
        choice and a logprob step at a time (pydantic's one call holds the GIL until it is done)."""
        parts = []
        for i, c in choices:
            choice = ChatCompletionResponseChoice(index=i, message=ChatResponseMessage(content=c.text),
                                                  finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            logprobs = b"null"
            if c.logprobs:
                steps = (to_json(self._step(t, step, top_k)) for t, step in zip(c.token_ids, c.logprobs))
                logprobs = b'{"content":[' + b",".join(steps) + b"]}"
            parts.append(splice_json(choice.model_dump_json(), "logprobs", logprobs))
        return splice_json(response.model_dump_json(), "choices", parts, b"[]")

    async def _stream(self, request: ChatCompletionRequest, streams: RequestStreams, request_id: str,
                      n: int, top_k: int) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[ChatCompletionStreamChoice], usage=None) -> str:
            return sse(ChatCompletionStreamResponse(id=request_id, created=created,
                                                    model=self.model_name, choices=choices, usage=usage))

        usage = UsageCounter()
        try:
            for index in range(n):
                yield chunk([ChatCompletionStreamChoice(
                    index=index, delta=DeltaMessage(role="assistant", content=""))])
            async for p, out in streams:
                usage.add(p, out)
                for delta in out.outputs:
                    if not (delta.text or delta.finish_reason or delta.logprobs):
                        continue  # tokens held back (a partial stop string or UTF-8 character)
                    logprobs = None
                    if delta.logprobs:
                        logprobs = self._logprobs(delta.token_ids, delta.logprobs, top_k)
                    yield chunk([ChatCompletionStreamChoice(
                        index=delta.index, delta=DeltaMessage(content=delta.text), logprobs=logprobs,
                        finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)])
            if request.include_usage:
                yield chunk([], usage.info())
        except Exception as e:  # the 200 is already sent: report in-band, as OpenAI does
            yield stream_error(e)
        finally:
            streams.abort()
        yield SSE_DONE

    def _logprobs(self, token_ids: list[int], steps: list[dict[int, Logprob]],
                  top_k: int) -> ChatLogProbs:
        """A streamed chunk's logprobs (a few steps)."""
        return ChatLogProbs.model_validate(
            {"content": [self._step(t, step, top_k) for t, step in zip(token_ids, steps)]})

    def _step(self, token_id: int, step: dict[int, Logprob], top_k: int) -> dict:
        """One ChatLogprobToken as a plain dict, its fields in the model's order (the JSON's)."""
        entry = self._entry(token_id, step[token_id])
        entry["top_logprobs"] = [self._entry(t, lp) for t, lp in top_by_rank(step, top_k)]
        return entry

    def _entry(self, token_id: int, logprob: Logprob) -> dict:
        """One ChatTopLogprob as a plain dict."""
        text = token_text(self.tokenizer, token_id, logprob)
        return {"token": text, "logprob": clamp_logprob(logprob.logprob), "bytes": list(text.encode())}
