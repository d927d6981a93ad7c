"""RequestStreams: the engine requests behind one HTTP request (one per prompt), started together,
consumed together, and aborted together when the HTTP request ends early.

This file owns what the server holds for a client that reads slower than the engine writes (or
not at all, with its connection open): outputs it has not taken yet are folded into one per
prompt, as vLLM's RequestOutputCollector does, so an unread stream costs what the same answer
held whole costs, not an object per token; and its unread logprob entries are bounded by
--max-logprob-entries, as a whole response's are (past it the stream ends with an error event).
It must never shape response bodies nor decide HTTP statuses (serving_engine.py and the
handlers do).
"""
from __future__ import annotations

import asyncio
import collections
import uuid
from typing import TYPE_CHECKING, AsyncIterator

from rackserve.outputs import RequestOutput
from rackserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from rackserve.engine.async_engine import AsyncEngine

Item = RequestOutput | BaseException | None     # an output, a failure, or None: that prompt ended


class UnreadStreamError(Exception):
    """The client left more logprob entries unread than the server holds for one request."""


def logprob_entries(out: RequestOutput) -> int:
    return sum(len(step) for c in out.outputs for step in c.logprobs or ())


class RequestStreams:
    """`start()` waits until every prompt produced its first output, so a prompt the engine
    rejects (too long, bad ids) fails the HTTP request before its response begins. Iterating
    yields (prompt_index, RequestOutput) deltas as they come; a delta that arrives while the
    previous one of its prompt is still untaken is folded into it. `abort()` (idempotent, sync
    so it is safe inside a cancelled task's `finally`) stops whatever has not finished.
    """

    def __init__(self, engine: AsyncEngine, prompts: list[str | list[int]], params: SamplingParams,
                 request_id: str, cache_salt: str | None = None, data_parallel_rank: int | None = None,
                 max_unread_entries: int | None = None) -> None:
        self.engine = engine
        self.cache_salt = cache_salt
        self.data_parallel_rank = data_parallel_rank
        self.max_unread_entries = max_unread_entries
        # A client's X-Request-Id is only the stem: two requests sent with the same one must
        # still get distinct engine ids.
        unique = uuid.uuid4().hex[:8]
        self.request_ids = [f"{request_id}-{unique}-{i}" for i in range(len(prompts))]
        self._queue: asyncio.Queue[tuple[int, Item]] = asyncio.Queue()
        self._ready: collections.deque[tuple[int, Item]] = collections.deque()
        self._untaken: dict[int, RequestOutput] = {}   # per prompt: the queued output later deltas fold into
        self._unread_entries = 0                       # logprob entries queued and not taken yet
        self._cut = False                              # past max_unread_entries: aborted, error queued
        self._finished: set[int] = set()
        self._tasks = [asyncio.create_task(self._pump(i, p, params)) for i, p in enumerate(prompts)]

    async def _pump(self, index: int, prompt: str | list[int], params: SamplingParams) -> None:
        try:
            async for out in self.engine.generate(prompt, params, self.request_ids[index], self.cache_salt,
                                                  data_parallel_rank=self.data_parallel_rank):
                self._put(index, out)
        except Exception as e:  # handed to the consumer, which decides between 400 and 500
            self._queue.put_nowait((index, e))
        else:
            self._queue.put_nowait((index, None))

    def _put(self, index: int, out: RequestOutput) -> None:
        if self._cut:
            return
        untaken = self._untaken.get(index)
        if untaken is None:
            self._untaken[index] = out
            self._queue.put_nowait((index, out))
        else:
            untaken.add(out)
        self._unread_entries += logprob_entries(out)
        limit = self.max_unread_entries
        if limit is not None and self._unread_entries > limit:
            # Aborting cancels the pumps (this one too): the error is the last item the consumer gets.
            self._cut = True
            self._queue.put_nowait((index, UnreadStreamError(
                f"the client left {self._unread_entries} logprob entries of this stream unread, more than "
                f"the server holds for one request ({limit}, --max-logprob-entries); the request was "
                "aborted. Read the stream as it arrives, or ask for fewer logprobs")))
            self.abort()

    async def _take(self) -> tuple[int, Item]:
        index, item = await self._queue.get()
        self._taken(index, item)
        return index, item

    def _taken(self, index: int, item: Item) -> None:
        """`item` leaves its prompt's fold: later deltas start a new one."""
        if item is not None and item is self._untaken.get(index):
            del self._untaken[index]
            self._unread_entries -= logprob_entries(item)

    async def start(self) -> None:
        """Raises the first prompt's error (ValueError: the engine refused it) after aborting all."""
        started: set[int] = set()
        while len(started) < len(self._tasks):
            index, item = await self._take()
            if isinstance(item, BaseException):
                self.abort()
                raise item
            if index in started and isinstance(item, RequestOutput):
                # A later delta of a prompt that already started: the consumer has not taken it,
                # so the deltas after it keep folding into it while start() waits for the others.
                self._untaken[index] = item
                self._unread_entries += logprob_entries(item)
            self._ready.append((index, item))
            started.add(index)

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        running = len(self._tasks)
        while running:
            if self._ready:
                index, item = self._ready.popleft()
                self._taken(index, item)
            else:
                index, item = await self._take()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                if item.finished:
                    self._finished.add(index)
                yield index, item

    def abort(self) -> None:
        for index, task in enumerate(self._tasks):
            task.cancel()
            if index not in self._finished:
                self.engine.abort(self.request_ids[index])
