"""ActiveLoads: what the router predicts each worker is busy with, from its own decisions alone
(Dynamo's ActiveSequences: no polling). A request counts from the moment it is routed until it
finishes; until its first token its uncached prompt tokens are also queued prefill work.

As in Dynamo, a worker's active blocks are the distinct prompt blocks (by chained hash) of its
unfinished requests: a block that several of them share (a common system prompt, a session's
history under a subagent) is one block of KV there, counted once. `new_blocks` is what a request
would add to that: its blocks no unfinished request on the worker holds yet.

Given a clock, it also times what it counts and teaches the workers' prices (pricing.py): a
request's TTFT against the prefill ahead of it on its worker (queued plus its own), and its ITL
against the worker's mean active blocks while it decoded (a time integral of active blocks).

This file owns the prediction only: it never picks a worker and never talks to an instance.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

from rackserve.router.index import WorkerKey
from rackserve.router.pricing import Price, Prices


@dataclass
class WorkerLoad:
    active_requests: int = 0
    active_blocks: int = 0        # distinct prompt blocks of the unfinished requests routed there
    prefill_blocks: float = 0.0   # uncached prompt tokens / block size of those before their first token


@dataclass
class _Routed:
    worker: WorkerKey
    hashes: Sequence[int]
    prefill_blocks: float
    prefilling: bool = True
    routed_at: float = 0.0
    prefill_ahead: float = 0.0     # prefill blocks up to its first token: queued on the worker + its own
    first_token_at: float | None = None    # streamed: when its first token arrived
    block_seconds_at_first_token: float = 0.0


def uncached_prefill_blocks(num_tokens: int, overlap_blocks: int, block_size: int) -> float:
    """A request's queued prefill in blocks: its prompt tokens beyond the cached prefix (the
    partial last block included, as Dynamo counts tokens), over the block size."""
    return max(num_tokens - overlap_blocks * block_size, 0) / block_size if block_size else 0.0


class ActiveLoads:
    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        """`clock` (seconds: time.monotonic in the router, virtual time in the simulator): time
        each request and learn the workers' prices; None: no timing, no prices."""
        self._loads: dict[WorkerKey, WorkerLoad] = {}
        self._refs: dict[WorkerKey, Counter[int]] = {}     # block hash -> unfinished requests holding it
        self._requests: dict[str, _Routed] = {}
        self.clock = clock
        self.prices = Prices()
        self._area: dict[WorkerKey, tuple[float, float]] = {}   # (active block-seconds so far, as of when)

    def get(self, worker: WorkerKey) -> WorkerLoad:
        return self._loads.get(worker) or WorkerLoad()

    def price(self, worker: WorkerKey) -> Price | None:
        return self.prices.price(worker) if self.clock is not None else None

    def block_seconds(self, worker: WorkerKey) -> float:
        """The time integral of the worker's active blocks up to now (clock given)."""
        area, since = self._area.get(worker, (0.0, self.clock()))
        now = self.clock()
        area += self.get(worker).active_blocks * (now - since)
        self._area[worker] = (area, now)
        return area

    def new_blocks(self, worker: WorkerKey, hashes: Sequence[int]) -> int:
        """Of a prompt's blocks, those no unfinished request on `worker` holds: what routing it
        there adds to the worker's active blocks."""
        refs = self._refs.get(worker)
        return len(hashes) if not refs else sum(1 for h in hashes if h not in refs)

    def add(self, request_id: str, worker: WorkerKey, hashes: Sequence[int], prefill_blocks: float) -> None:
        assert request_id not in self._requests, f"request {request_id} routed twice"
        routed = self._requests[request_id] = _Routed(worker, tuple(hashes), prefill_blocks)
        if self.clock is not None:
            self.block_seconds(worker)   # the area so far, at the old block count
            routed.routed_at, routed.prefill_ahead = self.clock(), self.get(worker).prefill_blocks + prefill_blocks
        load = self._loads.setdefault(worker, WorkerLoad())
        refs = self._refs.setdefault(worker, Counter())
        load.active_requests += 1
        load.prefill_blocks += prefill_blocks
        for block_hash in hashes:
            if refs[block_hash] == 0:
                load.active_blocks += 1
            refs[block_hash] += 1

    def first_token(self, request_id: str) -> None:
        """The request's first token arrived (a streamed one: its time is a TTFT to learn from)."""
        routed = self._requests.get(request_id)
        if routed is None or not routed.prefilling:
            return
        self._end_prefill(routed)
        if self.clock is not None:
            routed.first_token_at = self.clock()
            routed.block_seconds_at_first_token = self.block_seconds(routed.worker)
            self.prices.first_token(routed.worker, routed.prefill_ahead, routed.first_token_at - routed.routed_at)

    def _end_prefill(self, routed: _Routed) -> None:
        if routed.prefilling:
            routed.prefilling = False
            load = self._loads[routed.worker]
            # max(): float sums may leave -1e-15 where the exact total is 0.
            load.prefill_blocks = max(load.prefill_blocks - routed.prefill_blocks, 0.0)

    def finish(self, request_id: str, output_tokens: int | None = None) -> None:
        """Idempotent: a retried or failed request may finish twice. `output_tokens` (a streamed
        request that ended whole, from its usage) makes its ITL a point to learn from."""
        routed = self._requests.pop(request_id, None)
        if routed is None:
            return
        self._end_prefill(routed)
        if self.clock is not None:
            self._learn_decode(routed, output_tokens)
        load, refs = self._loads[routed.worker], self._refs[routed.worker]
        load.active_requests -= 1
        for block_hash in routed.hashes:
            refs[block_hash] -= 1
            if refs[block_hash] == 0:
                del refs[block_hash]
                load.active_blocks -= 1

    def _learn_decode(self, routed: _Routed, output_tokens: int | None) -> None:
        area = self.block_seconds(routed.worker)   # before its blocks leave
        if routed.first_token_at is None:
            return
        seconds = self.clock() - routed.first_token_at
        if output_tokens is None or output_tokens < 2 or seconds <= 0:
            return
        mean_blocks = (area - routed.block_seconds_at_first_token) / seconds
        self.prices.decoded(routed.worker, mean_blocks, seconds / (output_tokens - 1), output_tokens)

    def drop_worker(self, worker: WorkerKey) -> None:
        """Forget a worker that left the pool (its requests were failed or retried elsewhere)."""
        for request_id in [r for r, routed in self._requests.items() if routed.worker == worker]:
            self.finish(request_id)
        self._loads.pop(worker, None)
        self._refs.pop(worker, None)
        self._area.pop(worker, None)
