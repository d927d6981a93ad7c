"""ActiveLoads: what the router predicts each worker is busy with, from its own decisions alone
(Dynamo's way: no polling). A request counts from the moment it is routed until it finishes;
until its first token its uncached blocks are also queued prefill work.

This file owns the prediction only: it never picks a worker and never talks to an instance.
"""
from __future__ import annotations

from dataclasses import dataclass

from rackserve.router.index import WorkerKey


@dataclass
class WorkerLoad:
    active_requests: int = 0
    active_blocks: int = 0       # KV blocks of the requests routed there and not finished
    prefill_blocks: int = 0      # uncached blocks of those still waiting for their first token


@dataclass
class _Routed:
    worker: WorkerKey
    blocks: int
    uncached_blocks: int
    prefilling: bool = True


class ActiveLoads:
    def __init__(self) -> None:
        self._loads: dict[WorkerKey, WorkerLoad] = {}
        self._requests: dict[str, _Routed] = {}

    def get(self, worker: WorkerKey) -> WorkerLoad:
        return self._loads.get(worker) or WorkerLoad()

    def add(self, request_id: str, worker: WorkerKey, blocks: int, uncached_blocks: int) -> None:
        assert request_id not in self._requests, f"request {request_id} routed twice"
        self._requests[request_id] = _Routed(worker, blocks, uncached_blocks)
        load = self._loads.setdefault(worker, WorkerLoad())
        load.active_requests += 1
        load.active_blocks += blocks
        load.prefill_blocks += uncached_blocks

    def first_token(self, request_id: str) -> None:
        routed = self._requests.get(request_id)
        if routed is not None and routed.prefilling:
            routed.prefilling = False
            self._loads[routed.worker].prefill_blocks -= routed.uncached_blocks

    def finish(self, request_id: str) -> None:
        """Idempotent: a retried or failed request may finish twice."""
        self.first_token(request_id)
        routed = self._requests.pop(request_id, None)
        if routed is not None:
            load = self._loads[routed.worker]
            load.active_requests -= 1
            load.active_blocks -= routed.blocks

    def drop_worker(self, worker: WorkerKey) -> None:
        """Forget a worker that left the pool (its requests were failed or retried elsewhere)."""
        for request_id in [r for r, routed in self._requests.items() if routed.worker == worker]:
            self.finish(request_id)
        self._loads.pop(worker, None)
