"""A whole answer's JSON, built a choice and a logprob step at a time off the event loop
(serving_*._json, serving_engine.splice_json), is byte for byte what one model_dump_json of the
pydantic response writes: quotes, non-ASCII, -inf's floor and a kv_transfer_params that repeats
the spliced keys included."""
from __future__ import annotations

import random

from rackserve.outputs import Logprob
from rackserve.serve.protocol import (ChatCompletionResponse, ChatCompletionResponseChoice,
                                      ChatResponseMessage, CompletionLogProbs, CompletionResponse,
                                      CompletionResponseChoice, UsageInfo)
from rackserve.serve.serving_chat import OpenAIServingChat
from rackserve.serve.serving_completion import OpenAIServingCompletion
from rackserve.serve.serving_engine import ChoiceState

TEXTS = ["a", 'q"uote', "é", "\n", "\\", "日本", '"logprobs":null', '"choices":[]']
ODD = {"choices": [], "logprobs": None}


def _choices() -> list[tuple[int, ChoiceState]]:
    rng = random.Random(0)
    choices = []
    for i in range(3):
        steps = [{t: Logprob(float("-inf") if rank == 5 else -rng.random() * rng.choice([1e-5, 10]), rank + 1,
                             rng.choice(TEXTS) + str(t)) for rank, t in enumerate(rng.sample(range(500), 6))}
                 for _ in range(20)]
        choices.append((i, ChoiceState(text='t"é', token_ids=[next(iter(s)) for s in steps],
                                       logprobs=steps if i != 1 else [], finish_reason="length",
                                       stop_reason='"x"' if i == 2 else None)))
    return choices


def test_a_chat_answer_is_the_bytes_pydantic_writes():
    chat = OpenAIServingChat.__new__(OpenAIServingChat)
    chat.tokenizer = None
    choices = _choices()
    for kv in (None, ODD):
        empty = ChatCompletionResponse(id='c"', model="m", usage=UsageInfo(), kv_transfer_params=kv, choices=[])
        whole = empty.model_copy(update={"choices": [ChatCompletionResponseChoice(
            index=i, message=ChatResponseMessage(content=c.text), finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            logprobs=chat._logprobs(c.token_ids, c.logprobs, 5) if c.logprobs else None) for i, c in choices]})
        assert chat._json(empty, choices, 5) == whole.model_dump_json().encode()


def test_a_completion_answer_is_the_bytes_pydantic_writes():
    comp = OpenAIServingCompletion.__new__(OpenAIServingCompletion)
    comp.tokenizer = None
    choices = _choices()
    for kv in (None, ODD):
        empty = CompletionResponse(id="c", model="m", usage=UsageInfo(), kv_transfer_params=kv, choices=[])
        whole = empty.model_copy(update={"choices": [CompletionResponseChoice(
            index=i, text=c.text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            logprobs=CompletionLogProbs(**comp._logprobs(c.token_ids, c.logprobs, 0)) if c.logprobs else None,
            prompt_token_ids=[1, 2], token_ids=c.token_ids) for i, c in choices]})
        assert comp._json(empty, choices, {0: [1, 2]}, 3, True) == whole.model_dump_json().encode()


def test_a_stream_event_is_one_line_to_every_line_splitter():
    """A token's text may hold U+2028, U+2029 or NEL, which str.splitlines and httpx's aiter_lines
    take for line breaks: each event escapes them, so it reads back as one line and the same text."""
    import json

    import httpx

    from rackserve.serve.serving_engine import sse
    text = "a\u2028b\u2029c\x85d\x0be\x1cf\ng\u00e9"
    event = sse(CompletionResponse(id="x", created=0, model="m", choices=[
        CompletionResponseChoice(index=0, text=text, finish_reason=None)]))
    lines = [line for line in httpx.Response(200, content=event.encode()).iter_lines() if line]
    assert len(lines) == 1 == len([line for line in event.splitlines() if line])
    assert json.loads(lines[0].removeprefix("data: "))["choices"][0]["text"] == text
