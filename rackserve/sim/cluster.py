"""The simulated cluster on virtual time: instances (each the real EngineCore, its real
Schedulers and KV cache managers, over a SimExecutor), a routing policy between them, and
SimClient, which stands where bench's ChatClient stands, so bench's own Replay (lanes, plays,
warm-ups, think times, deadline) drives the simulation unchanged and fills the same RequestRecords.

Routing is sim/routing.py's (the cluster router's policies, fed each step's KV events).
Prompt text becomes token ids word by word (bench renders each token of a block as one word), so
equal blocks are equal tokens and the real prefix cache sees the workload's sharing. An instance's
step loop steps its engine core, sleeps the step's virtual seconds, then delivers the tokens.
It must never read the wall clock (virtual_loop.py owns time).
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Callable

from rackserve.bench.metrics import CONTEXT_OVERFLOW, RequestRecord
from rackserve.core.request import Request
from rackserve.engine.core import EngineCore
from rackserve.sampling_params import SamplingParams
from rackserve.sim.executor import SimExecutor
from rackserve.sim.routing import SimRouter


@dataclass
class _Pending:
    record: RequestRecord
    done: asyncio.Future
    on_first: Callable[[], None]
    tokens: int = 0


@dataclass
class InstanceStats:
    steps: int = 0
    busy_seconds: float = 0.0           # virtual seconds spent stepping
    prefix_hits: int = 0
    prefix_queries: int = 0
    preemptions: int = 0
    dp_idle_seconds: float = 0.0        # summed over DP ranks: waiting for the slowest rank
    dp_busy_seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)


class SimInstance:
    def __init__(self, index: int, core: EngineCore, clock: Callable[[], float],
                 on_step: Callable[[int, list[list]], None] = lambda index, kv_events: None):
        """`on_step(index, kv_events_by_rank)`: after each step, its DP ranks' KV events (a router's
        index follows them)."""
        assert isinstance(core.executor, SimExecutor), "a simulated instance runs the sim executor"
        self.index, self.core, self.clock, self.on_step = index, core, clock, on_step
        self.pending: dict[str, _Pending] = {}
        self.stats = InstanceStats()
        self._wake = asyncio.Event()

    @property
    def max_model_len(self) -> int:
        return self.core.config.model.max_model_len

    def load(self) -> int:
        """Requests in flight here (least-load routing balances this)."""
        return len(self.pending)

    async def generate(self, req_id: str, token_ids: list[int], max_tokens: int, record: RequestRecord,
                       dp_rank: int | None = None, on_first: Callable[[], None] = lambda: None) -> None:
        """Run one request to its end, filling `record` as a streaming client would; on `dp_rank`
        when a router pinned one, else where the engine places it."""
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        if len(token_ids) + max_tokens > self.max_model_len:
            record.error, record.error_message = CONTEXT_OVERFLOW, f"maximum context length is {self.max_model_len}"
            return
        self.core.add_requests([Request(req_id, token_ids, params, arrival_time=self.clock())], dp_rank)
        pending = self.pending[req_id] = _Pending(record, asyncio.get_running_loop().create_future(), on_first)
        record.prompt_tokens = len(token_ids)
        self._wake.set()
        await pending.done

    async def run(self) -> None:
        """The step loop, until cancelled."""
        executor = self.core.executor
        while True:
            if not self.core.has_unfinished_requests():
                self._wake.clear()
                await self._wake.wait()
                continue
            outputs, stats = self.core.step()
            seconds = executor.last_step_seconds
            self._account(stats, seconds)
            self.on_step(self.index, [r.kv_events for r in stats.dp_ranks])
            # An empty step (nothing fits yet) still lets time pass, so arrivals can change that.
            await asyncio.sleep(max(seconds, 1e-4))
            now = self.clock()
            for out in outputs:
                pending = self.pending.get(out.req_id)
                if pending is None:
                    continue
                record = pending.record
                if out.new_token_ids:
                    if record.first_chunk is None:
                        record.first_chunk = now
                        pending.on_first()
                    record.chunk_times.append(now)
                    pending.tokens += len(out.new_token_ids)
                if out.finished:
                    record.output_tokens, record.cached_tokens = pending.tokens, out.num_cached_tokens
                    del self.pending[out.req_id]
                    pending.done.set_result(None)

    def _account(self, stats, seconds: float) -> None:
        s = self.stats
        s.steps += 1
        s.busy_seconds += seconds
        s.step_seconds.append(seconds)
        s.prefix_hits += stats.prefix_cache_hits
        s.prefix_queries += stats.prefix_cache_queries
        s.preemptions += stats.num_preemptions
        if len(stats.dp_ranks) > 1:
            s.dp_idle_seconds += sum(r.idle_seconds for r in stats.dp_ranks)
            s.dp_busy_seconds += sum(r.busy_seconds or 0.0 for r in stats.dp_ranks)


class Tokens:
    """Word -> token id, stable within a simulation: one word of bench's prompt text is one token."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.ids
        return [ids.setdefault(word, len(ids)) for m in messages for word in m["content"].split()]


class SimClient:
    """bench's ChatClient, on virtual time: `send(messages, record)` and `clock`."""

    def __init__(self, instances: list[SimInstance], router: SimRouter, clock: Callable[[], float]):
        self.instances, self.router, self.clock = instances, router, clock
        self.tokens = Tokens()
        self._ids = itertools.count()
        self.prefill: list[SimInstance] = []

    def disaggregate(self, prefill: list[SimInstance], router: SimRouter,
                     transfer_seconds: Callable[[int], float]) -> None:
        """P/D: prompts are computed on `prefill` instances (their first token is the TTFT), their
        new KV then crosses the link (transfer_seconds(tokens)) to a decode instance."""
        self.prefill, self.prefill_router, self.transfer_seconds = prefill, router, transfer_seconds

    async def send(self, messages: list[dict[str, str]], record: RequestRecord) -> RequestRecord:
        token_ids = self.tokens.encode(messages)
        record.start = self.clock()
        if self.prefill:
            await self._disaggregated(token_ids, record)
        else:
            await self._routed(self.instances, self.router, f"sim-{next(self._ids)}", token_ids,
                               record.max_tokens, record)
        record.end = self.clock()
        return record

    @staticmethod
    async def _routed(instances: list[SimInstance], router: SimRouter, req_id: str, token_ids: list[int],
                      max_tokens: int, record: RequestRecord) -> None:
        route = router.pick(instances, token_ids, req_id)
        try:
            await instances[route.instance].generate(req_id, token_ids, max_tokens, record, route.dp_rank,
                                                     lambda: router.first_token(req_id))
        finally:
            router.finish(req_id)

    async def _disaggregated(self, token_ids: list[int], record: RequestRecord) -> None:
        req_id = f"sim-{next(self._ids)}"
        await self._routed(self.prefill, self.prefill_router, req_id, token_ids, 1, record)
        if not record.ok or record.max_tokens == 1:
            return
        await asyncio.sleep(self.transfer_seconds(len(token_ids) - (record.cached_tokens or 0)))
        rest = dataclasses.replace(record, chunk_times=[], first_chunk=None)
        # The first token came from the prefill instance; its id is a stand-in here too.
        await self._routed(self.instances, self.router, req_id + "-d", token_ids + [0], record.max_tokens - 1, rest)
        record.error, record.error_message = rest.error, rest.error_message
        record.chunk_times += rest.chunk_times
        record.output_tokens = 1 + (rest.output_tokens or 0)
