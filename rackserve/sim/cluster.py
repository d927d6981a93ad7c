"""The simulated cluster on virtual time: instances (each the real EngineCore, its real
Schedulers and KV cache managers, over a SimExecutor), a routing policy between them, and
SimClient, which stands where bench's ChatClient stands, so bench's own Replay (lanes, plays,
warm-ups, think times, deadline) drives the simulation unchanged and fills the same RequestRecords.

Routing is sim/routing.py's (the cluster router's policies, fed each step's KV events).
Prompts become token ids word by word (bench renders each token of a block as one word; the
simulator's renderer hands the blocks over as they are, prompt_ids.py), so equal blocks are equal
tokens and the real prefix cache sees the workload's sharing. An instance's
step loop steps its engine core, sleeps the step's virtual seconds, then delivers the tokens.
It must never read the wall clock (virtual_loop.py owns time).
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Callable

from rackserve.bench.metrics import CONTEXT_OVERFLOW, RequestRecord
from rackserve.core.request import Request
from rackserve.engine.core import EngineCore
from rackserve.sampling_params import SamplingParams
from rackserve.sim.chat_template import TemplateTokens
from rackserve.sim.executor import SimExecutor
from rackserve.sim.prompt_ids import Tokens
from rackserve.sim.routing import Route, SimRouter


@dataclass
class _Pending:
    record: RequestRecord
    done: asyncio.Future
    on_first: Callable[[], None]
    tokens: int = 0
    kv_transfer_params: dict | None = None     # what the request's end hands a decoder (P/D)


@dataclass
class InstanceStats:
    steps: int = 0
    busy_seconds: float = 0.0           # virtual seconds spent stepping
    prefix_hits: int = 0
    prefix_queries: int = 0
    preemptions: int = 0
    drafts: int = 0                     # decodes that verified drafts, their drafts, the drafts kept
    draft_tokens: int = 0
    accepted_tokens: int = 0
    step_seconds: list[float] = field(default_factory=list)
    # (start, idle, busy) a DP step; idle and busy summed over its ranks (idle: waiting for the slowest)
    dp_steps: list[tuple[float, float, float]] = field(default_factory=list)


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

    async def generate(self, req_id: str, token_ids: Sequence[int], max_tokens: int, record: RequestRecord,
                       dp_rank: int | None = None, on_first: Callable[[], None] = lambda: None,
                       kv_transfer_params: dict | None = None, route: Route | None = None) -> dict | None:
        """Run one request to its end, filling `record` as a streaming client would; on `dp_rank`
        when a router pinned one, else where the engine places it. Returns the kv_transfer_params
        its end hands back (a P/D prefill's: where a decoder pulls its KV). The `route`'s block
        hashes, where they are the ones this engine would compute, spare it hashing the prompt."""
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, kv_transfer_params=kv_transfer_params)
        if len(token_ids) + max_tokens > self.max_model_len:
            record.error, record.error_message = CONTEXT_OVERFLOW, f"maximum context length is {self.max_model_len}"
            return None
        kv = self.core.schedulers[0].kv
        hashes = (list(route.block_hashes) if route is not None and route.block_hashes is not None
                  and route.block_size == kv.block_size and kv.hash_seed == 0 and kv.enable_caching else [])
        self.core.add_requests([Request(req_id, token_ids, params, arrival_time=self.clock(), block_hashes=hashes)],
                               dp_rank)
        pending = self.pending[req_id] = _Pending(record, asyncio.get_running_loop().create_future(), on_first)
        record.prompt_tokens = len(token_ids)
        self._wake.set()
        await pending.done
        return pending.kv_transfer_params

    async def run(self) -> None:
        """The step loop, until cancelled."""
        executor = self.core.executor
        while True:
            # Blocks held for a decoder keep the steps going, to hear when they may go.
            if not (self.core.has_unfinished_requests() or self.core.has_kv_transfers()):
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
                    pending.kv_transfer_params = out.kv_transfer_params
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
        s.drafts += stats.num_drafts
        s.draft_tokens += stats.num_draft_tokens
        s.accepted_tokens += stats.num_accepted_tokens
        if len(stats.dp_ranks) > 1:
            s.dp_steps.append((self.clock(), sum(r.idle_seconds for r in stats.dp_ranks),
                               sum(r.busy_seconds or 0.0 for r in stats.dp_ranks)))


def _key(record: RequestRecord) -> tuple:
    """The prompt's session, for the routers' PromptHashes."""
    return record.lane, record.play, record.session_id


class SimClient:
    """bench's ChatClient, on virtual time: `send(messages, record)` and `clock`."""

    def __init__(self, instances: list[SimInstance], router: SimRouter, clock: Callable[[], float],
                 vocab_size: int, template: TemplateTokens = TemplateTokens(), front: tuple[float, float] = (0.0, 0.0),
                 marker: Callable[[str], Sequence[int]] | None = None):
        self.instances, self.router, self.clock = instances, router, clock
        self.front = front      # the serving front path: (seconds a request, seconds a prompt token)
        self.tokens = Tokens(vocab_size, template, marker)   # marker: the server's tokens of bench's play marker
        self._ids = itertools.count()
        self.prefill: list[SimInstance] = []

    def disaggregate(self, prefill: list[SimInstance], router: SimRouter) -> None:
        """P/D, as router/pd_proxy.py does it: a prompt goes first to a `prefill` instance with
        max_tokens=1 and do_remote_decode, then whole to a decode instance with the params the
        prefill handed back; the decoder's connector pulls the KV over the link (sim/transfer.py)
        and its tokens are the ones streamed (its first is the TTFT)."""
        self.prefill, self.prefill_router = prefill, router

    async def send(self, messages: list[dict[str, str]], record: RequestRecord) -> RequestRecord:
        token_ids = self.tokens.encode(messages)
        record.start = self.clock()
        if self.front != (0.0, 0.0):     # HTTP, template and tokenizer before the engine sees it
            await asyncio.sleep(self.front[0] + self.front[1] * len(token_ids))
        if self.prefill:
            await self._disaggregated(token_ids, record)
        else:
            await self._routed(self.instances, self.router, f"sim-{next(self._ids)}", token_ids,
                               record.max_tokens, record, key=_key(record))
        record.end = self.clock()
        return record

    @staticmethod
    async def _routed(instances: list[SimInstance], router: SimRouter, req_id: str, token_ids: Sequence[int],
                      max_tokens: int, record: RequestRecord, kv_transfer_params: dict | None = None,
                      key: tuple | None = None) -> dict | None:
        route = router.pick(instances, token_ids, req_id, key)
        output_tokens = None     # a request that failed teaches the router nothing
        try:
            params = await instances[route.instance].generate(req_id, token_ids, max_tokens, record, route.dp_rank,
                                                              lambda: router.first_token(req_id), kv_transfer_params,
                                                              route)
            output_tokens = record.output_tokens if record.ok else None
            return params
        finally:
            router.finish(req_id, output_tokens)

    async def _disaggregated(self, token_ids: Sequence[int], record: RequestRecord) -> None:
        req_id = f"sim-{next(self._ids)}"
        prefilled = dataclasses.replace(record, chunk_times=[], first_chunk=None)
        params = await self._routed(self.prefill, self.prefill_router, req_id, token_ids, 1, prefilled,
                                    {"do_remote_decode": True}, _key(record))
        if not prefilled.ok:
            record.error, record.error_message = prefilled.error, prefilled.error_message
            return
        await self._routed(self.instances, self.router, req_id + "-d", token_ids, record.max_tokens, record, params,
                           _key(record))
        # The hit rate is the prefill pool's, where a hit saves compute.
        record.cached_tokens = prefilled.cached_tokens
