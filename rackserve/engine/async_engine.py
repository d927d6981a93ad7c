"""AsyncEngine: the LLMEngine driven by one background thread, with an asyncio face for servers.

The engine thread alone touches the LLMEngine: callers hand it commands (add, abort) through a
queue, and it hands each request's outputs back to that request's asyncio queue on the caller's
event loop. Tokenization and validation run in the caller, so a bad request fails before it is
queued. If a step raises, every in-flight request fails with that error and the engine is dead
(check_health raises); it never hangs a caller.
"""
from __future__ import annotations

import asyncio
import functools
import gc
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from collections.abc import AsyncIterator
from typing import Any

from rackserve.config import EngineArgs, EngineConfig
from rackserve.engine.llm_engine import (EngineDeadError, EngineOverloadedError, LLMEngine, PreparedRequest,
                                         PromptType, RequestFailedError)
from rackserve.engine.stats import StatLogger
from rackserve.outputs import RequestOutput
from rackserve.sampling_params import SamplingParams

# How much lower than the engine the prompt-preparing threads run (nice values: 10 weighs ~1/9).
PREPARE_NICENESS = 10


class AsyncEngine:
    def __init__(self, config: EngineConfig | EngineArgs, stat_loggers: list[StatLogger] | tuple = (),
                 max_waiting_requests: int | None = None):
        """`max_waiting_requests`: most sequences (a request counts its n) taken but without a
        first token yet; None: unbounded."""
        self.max_waiting_requests = max_waiting_requests
        self.num_waiting = 0              # sequences taken, no first token yet (the callers' loop only)
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self._error: BaseException | None = None
        # The engine is built on the thread that steps it, so one thread alone opens OpenMP
        # regions: libgomp gives each such thread a pool of its own, and once the threads it manages
        # (every pool's) outnumber the cores its barriers spin a short throttled count instead of
        # ~300,000 times, so each of a step's ~150 regions would wake sleeping workers (a served
        # decode step measured up to 2x bench forward's).
        failed: list[BaseException] = []
        ready = threading.Event()
        self._thread = threading.Thread(target=self._build_and_run, args=(config, stat_loggers, failed, ready),
                                        name="rackserve-engine", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            self._thread.join()
            raise failed[0]
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        # Prompts are tokenized and checked in these threads, at a lower OS priority than the
        # engine thread: a body of many long prompts keeps them busy for seconds (the tokenizer
        # lets go of the GIL), and on a machine with few cores the engine's steps must win.
        self._prepare_pool = ThreadPoolExecutor(min(32, (os.cpu_count() or 1) + 4), "rackserve-prepare",
                                                initializer=_lower_priority)

    async def generate(self, prompt: PromptType | list[int], params: SamplingParams, request_id: str,
                       cache_salt: str | None = None,
                       data_parallel_rank: int | None = None) -> AsyncIterator[RequestOutput]:
        """Yield RequestOutput deltas until the request finishes. Raises ValueError before the
        first yield for a request that can never run; aborts the request if the caller stops
        iterating early (a client that went away)."""
        self.check_health()
        weight = params.n
        if self.max_waiting_requests is not None and self.num_waiting + weight > self.max_waiting_requests:
            raise EngineOverloadedError(
                f"the server is at capacity ({self.num_waiting} sequences waiting for a first token, "
                f"limit {self.max_waiting_requests}); retry later")
        self.num_waiting += weight
        finished = added = False
        try:
            prepared = await asyncio.get_running_loop().run_in_executor(self._prepare_pool, functools.partial(
                self.engine.prepare, request_id, prompt, params, cache_salt, data_parallel_rank))
            stream: asyncio.Queue = asyncio.Queue()
            self._send("add", (prepared, asyncio.get_running_loop(), stream))
            added = True
            self.check_health()   # the engine may have died before it could take the request
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                if weight:
                    self.num_waiting -= weight
                    weight = 0
                failure = next((o.stop_reason for o in item.outputs if o.finish_reason == "error"), None)
                if failure is not None:
                    raise RequestFailedError(str(failure))
                finished = item.finished
                yield item
        except asyncio.CancelledError:
            if not added:
                # The caller left while its prompt was being tokenized: the engine never saw it,
                # but it was a request, and it ended as an abort (counted with the others).
                self._send("abort_unstarted", params.n)
            raise
        finally:
            self.num_waiting -= weight
            if added and not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Thread-safe; unknown or finished ids are ignored."""
        self._send("abort", request_id)

    @property
    def failure(self) -> BaseException | None:
        """Why the engine died, if a step raised (None after a plain shutdown)."""
        return self._error

    def check_health(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self._error!r}")
        if self._stopping or not self._thread.is_alive():
            raise EngineDeadError("the engine is shut down")

    @property
    def stepping(self) -> bool:
        """Whether the engine thread still runs: after shutdown(), a step it could not wait for."""
        return self._thread.is_alive()

    def shutdown(self, timeout: float = 60.0) -> None:
        """Fail every request in flight at once, let the step in progress end for up to `timeout`
        s, then stop the executor (its workers, if any, are stopped: a step waiting on them ends).
        A step still running after that is left (`stepping`): the process must then end without
        finalizing (os._exit), since an interpreter that finalizes while a thread is inside torch
        aborts (SIGABRT, "terminate called without an active exception")."""
        if not self._stopping:
            self._stopping = True
            self._wake.set()
            # The callers hear now, not once the step in progress ends (a long prefill on a busy
            # machine outlasted the server's grace period: its requests got uvicorn's bare 500).
            reason = EngineDeadError("the engine was shut down")
            for loop, stream in list(self._streams.values()):
                _put(loop, stream, reason)
            self._thread.join(timeout=timeout)
            self.engine.shutdown()
            self._prepare_pool.shutdown(wait=False, cancel_futures=True)

    # -- the engine thread --------------------------------------------------------------------
    def _send(self, kind: str, payload: Any) -> None:
        self._commands.put((kind, payload))
        self._wake.set()

    def _build_and_run(self, config: EngineConfig | EngineArgs, stat_loggers: list[StatLogger] | tuple,
                       failed: list[BaseException], ready: threading.Event) -> None:
        try:
            self.engine = LLMEngine(config, stat_loggers)
        except BaseException as e:   # noqa: BLE001 - the constructor re-raises it in the caller
            failed.append(e)
            return
        finally:
            ready.set()
        # What start-up built (torch, the tokenizer, the model's modules: ~1M objects) lives as long
        # as the engine: frozen out of the collector, a full collection while serving scans only
        # what serving allocated (one took 117-390 ms unfrozen, stalling a step), as vLLM does.
        gc.collect()
        gc.freeze()
        self._run()

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._apply_commands()
                if not self.engine.has_unfinished_requests() and self.engine.core.has_kv_transfers():
                    self.engine.step()   # no request, but peers' transfers to hear about
                    self._wake.wait(0.01)
                    self._wake.clear()
                    continue
                if not self.engine.has_unfinished_requests():
                    self.engine.record_idle_stats()
                    self._wake.wait()
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    self._deliver(out.request_id, out, out.finished)
            reason: BaseException = EngineDeadError("the engine was shut down")
        except BaseException as e:   # noqa: BLE001 - every caller must hear about it
            if self._stopping:   # shutdown() stopped the executor under this step: not a failure
                reason = EngineDeadError("the engine was shut down")
            else:
                self._error = e
                reason = EngineDeadError(f"the engine failed: {e!r}")
        # Nobody will step again: fail what is in flight and what is still queued.
        for request_id in list(self._streams):
            self._deliver(request_id, reason, True)
        while not self._commands.empty():
            kind, payload = self._commands.get_nowait()
            if kind == "add":
                _, loop, stream = payload
                _put(loop, stream, reason)

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                prepared, loop, stream = payload
                self._add(prepared, loop, stream)
            elif kind == "abort_unstarted":
                self.engine.processor.record_unstarted_abort(payload)
            else:
                self._streams.pop(payload, None)
                self.engine.abort_request(payload)

    def _add(self, prepared: PreparedRequest, loop: asyncio.AbstractEventLoop, stream: asyncio.Queue) -> None:
        try:
            self.engine.add_prepared(prepared)
        except ValueError as e:   # e.g. a duplicate request id
            _put(loop, stream, e)
            return
        self._streams[prepared.request_id] = (loop, stream)

    def _deliver(self, request_id: str, item: Any, last: bool) -> None:
        target = self._streams.pop(request_id, None) if last else self._streams.get(request_id)
        if target is not None:
            _put(*target, item)


def _put(loop: asyncio.AbstractEventLoop, stream: asyncio.Queue, item: Any) -> None:
    """Hand an item to a caller's queue from the engine thread (a closed loop has nobody left)."""
    if not loop.is_closed():
        loop.call_soon_threadsafe(stream.put_nowait, item)


def _lower_priority() -> None:
    """This thread's nice value 10 above the process's (Linux sets it per thread), so that the
    engine thread and torch's threads win the CPU over tokenization."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + PREPARE_NICENESS))
    except (AttributeError, OSError):   # not Linux, or not allowed: the same priority as the rest
        pass
