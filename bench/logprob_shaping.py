"""How long the event loop is held while a non-streaming chat answer's logprobs are shaped, in
process: synthetic steps (390 tokens x 20 top logprobs a choice, the shape of n=128,
max_tokens=390, top_logprobs=20, which --max-logprob-entries' default 2^20 admits), with Python's
cyclic GC on as the server runs it. Two ways, alternated in one run:
  inline: what main did before hunt6, on the loop: one pydantic object per entry, then one
          model_dump_json (the loop is held for all of it);
  thread: what the server does now, OpenAIServingChat._json in asyncio.to_thread (plain dicts,
          serialized a step at a time), while a task on the loop ticks every 1 ms: its longest
          gap is what another client waits.
It serves nothing; a served request would also pay generating the tokens first.

  python bench/logprob_shaping.py --choices 32,128 --output bench/results/logprob-shaping-h6.json
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rackserve.cpu_dtype import cpu_identity  # noqa: E402
from rackserve.outputs import Logprob  # noqa: E402
from rackserve.serve.protocol import (ChatCompletionResponse, ChatCompletionResponseChoice,  # noqa: E402
                                      ChatResponseMessage, UsageInfo)
from rackserve.serve.serving_chat import OpenAIServingChat  # noqa: E402
from rackserve.serve.serving_engine import ChoiceState  # noqa: E402

TOKENS, TOP = 390, 20


def inline(chat: OpenAIServingChat, choices: list[tuple[int, ChoiceState]]) -> bytes:
    response = ChatCompletionResponse(id="x", model="m", usage=UsageInfo(), choices=[ChatCompletionResponseChoice(
        index=i, message=ChatResponseMessage(content=c.text), finish_reason=c.finish_reason,
        logprobs=chat._logprobs(c.token_ids, c.logprobs, TOP)) for i, c in choices])
    return response.model_dump_json().encode()


async def threaded(chat: OpenAIServingChat, choices: list[tuple[int, ChoiceState]]) -> tuple[bytes, float]:
    """The answer and the loop's longest gap between 1 ms ticks while the thread shaped it."""
    gaps, done = [0.0], False

    async def tick() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps[0], last = max(gaps[0], now - last), now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.01)
    response = ChatCompletionResponse(id="x", model="m", usage=UsageInfo(), choices=[])
    body = await asyncio.to_thread(chat._json, response, choices, TOP)
    done = True
    await ticker
    return body, gaps[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--choices", default="8,32", help="comma-separated numbers of choices")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    chat = OpenAIServingChat.__new__(OpenAIServingChat)
    chat.tokenizer = None   # token texts come from each Logprob's decoded_token
    rng = random.Random(0)
    steps = [{t: Logprob(-rng.random(), rank + 1, f"tok{t}") for rank, t in enumerate(rng.sample(range(49152), TOP))}
             for _ in range(TOKENS)]
    ids = [next(iter(step)) for step in steps]
    gc.collect()
    gc.freeze()   # as the server does after start-up: only what serving allocates is scanned
    result = {"command": " ".join(sys.argv), "cpu": cpu_identity(), "loadavg_before": os.getloadavg(), "runs": []}
    for n in map(int, args.choices.split(",")):
        choices = [(i, ChoiceState(text="x", token_ids=ids, logprobs=steps, finish_reason="length"))
                   for i in range(n)]
        for way in ("inline", "thread"):
            t0 = time.perf_counter()
            if way == "inline":
                body, held = inline(chat, choices), None
            else:
                body, held = asyncio.run(threaded(chat, choices))
            seconds = time.perf_counter() - t0
            run = {"choices": n, "entries": n * TOKENS * (TOP + 1), "way": way, "seconds": round(seconds, 2),
                   "loop_held_s": round(seconds if held is None else held, 3), "bytes": len(body)}
            del body
            gc.collect()
            result["runs"].append(run)
            print(run, flush=True)
    result["loadavg_after"] = os.getloadavg()
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
