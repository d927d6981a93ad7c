"""/v1/completions: prompts (text or token ids, one or a batch) in, text out, whole or as SSE.

This file owns the legacy completions response shape, including its logprobs format (tokens,
token_logprobs, top_logprobs as {token: logprob}, text_offset). It must never validate
sampling values (SamplingParams does) nor decide whether a prompt fits the context (the engine
does, and RequestStreams turns its refusal into a 400). A whole answer is JSON text built in a
worker thread a choice at a time, its logprobs as plain lists (see serving_chat).
"""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import AsyncIterator

from pydantic_core import to_json

from rackserve.outputs import Logprob
from rackserve.serve.protocol import (CompletionLogProbs, CompletionRequest, CompletionResponse,
                                      CompletionResponseChoice)
from rackserve.serve.request_streams import RequestStreams
from rackserve.serve.serving_engine import (SSE_DONE, ChoiceState, OpenAIServing,
                                            UsageCounter, clamp_logprob, splice_json, sse,
                                            stream_error, token_text, top_by_rank)


class OpenAIServingCompletion(OpenAIServing):

    async def create_completion(self, request: CompletionRequest, request_id: str | None = None
                                ) -> bytes | AsyncIterator[str]:
        """The response's JSON (a CompletionResponse), or (stream=True) an iterator of SSE events
        already past the first token.
        `request_id` (the client's X-Request-Id) is the stem of the response's and engine's ids."""
        prompts = request.prompts()
        self.check_request(request, len(prompts), request.logprobs, request.best_of)
        params = self.sampling_params(request, request.max_tokens, request.logprobs)
        self.check_held_logprobs(params, prompts, request.stream)
        request_id = f"cmpl-{request_id or uuid.uuid4().hex}"
        streams = await self.start(prompts, params, request_id, request.cache_salt,
                                   request.data_parallel_rank)
        # Without a tokenizer the text is empty: the token ids are the answer.
        with_ids = request.return_token_ids or self.tokenizer is None
        if request.stream:
            return self._stream(request, streams, request_id, params.n, with_ids)
        try:
            return await self._collect(streams, request_id, params.n, with_ids)
        finally:
            streams.abort()

    async def _collect(self, streams: RequestStreams, request_id: str, n: int,
                       with_ids: bool) -> bytes:
        choices: dict[int, ChoiceState] = {}
        prompt_ids: dict[int, list[int]] = {}
        usage = UsageCounter()
        kv_transfer_params = None
        async for p, out in streams:
            usage.add(p, out)
            prompt_ids[p] = out.prompt_token_ids
            kv_transfer_params = out.kv_transfer_params or kv_transfer_params
            for delta in out.outputs:
                choices.setdefault(p * n + delta.index, ChoiceState()).add(delta)
        response = CompletionResponse(id=request_id, model=self.model_name, usage=usage.info(),
                                      kv_transfer_params=kv_transfer_params, choices=[])
        return await asyncio.to_thread(self._json, response, sorted(choices.items()), prompt_ids, n, with_ids)

    def _json(self, response: CompletionResponse, choices: list[tuple[int, ChoiceState]],
              prompt_ids: dict[int, list[int]], n: int, with_ids: bool) -> bytes:
        """`response`'s JSON with these choices, serialized a choice at a time off the event loop
        (as serving_chat's _json: one model_dump_json of ~1M logprob entries holds the GIL)."""
        parts = []
        for i, c in choices:
            choice = CompletionResponseChoice(
                index=i, text=c.text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                prompt_token_ids=prompt_ids[i // n] if with_ids else None,
                token_ids=c.token_ids if with_ids else None)
            logprobs = to_json(self._logprobs(c.token_ids, c.logprobs, 0)) if c.logprobs else b"null"
            parts.append(splice_json(choice.model_dump_json(), "logprobs", logprobs))
        return splice_json(response.model_dump_json(), "choices", parts, b"[]")

    async def _stream(self, request: CompletionRequest, streams: RequestStreams, request_id: str,
                      n: int, with_ids: bool) -> AsyncIterator[str]:
        created = int(time.time())
        choices: dict[int, ChoiceState] = {}
        usage = UsageCounter()
        try:
            async for p, out in streams:
                usage.add(p, out)
                for delta in out.outputs:
                    index = p * n + delta.index
                    state = choices.setdefault(index, ChoiceState())
                    if not (delta.text or delta.finish_reason or delta.logprobs or with_ids and delta.token_ids):
                        continue  # tokens held back (a partial stop string or UTF-8 character)
                    first_chunk, state.opened = not state.opened, True
                    logprobs = None
                    if delta.logprobs:
                        logprobs = CompletionLogProbs.model_validate(
                            self._logprobs(delta.token_ids, delta.logprobs, state.text_offset))
                    state.text_offset += len(delta.text)
                    yield sse(CompletionResponse(
                        id=request_id, created=created, model=self.model_name,
                        choices=[CompletionResponseChoice(
                            index=index, text=delta.text, logprobs=logprobs,
                            finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
                            prompt_token_ids=out.prompt_token_ids if with_ids and first_chunk else None,
                            token_ids=delta.token_ids if with_ids else None)]))
            if request.include_usage:
                yield sse(CompletionResponse(id=request_id, created=created, model=self.model_name,
                                             choices=[], usage=usage.info()))
        except Exception as e:  # the 200 is already sent: report in-band, as OpenAI does
            yield stream_error(e)
        finally:
            streams.abort()
        yield SSE_DONE

    def _logprobs(self, token_ids: list[int], steps: list[dict[int, Logprob]],
                  text_offset: int) -> dict:
        """A CompletionLogProbs as a plain dict, its fields in the model's order (the JSON's)."""
        result: dict[str, list] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for token_id, step in zip(token_ids, steps):
            text = token_text(self.tokenizer, token_id, step.get(token_id))
            result["tokens"].append(text)
            result["token_logprobs"].append(clamp_logprob(step[token_id].logprob))
            top: dict[str, float] = {}
            for t, lp in top_by_rank(step, len(step)):
                # Tokens that decode alike (byte pieces of one character) share a key: keep the likelier.
                top.setdefault(token_text(self.tokenizer, t, lp), clamp_logprob(lp.logprob))
            result["top_logprobs"].append(top)
            result["text_offset"].append(text_offset)
            text_offset += len(text)
        return result
