"""ActiveLoads: what the router predicts each worker is busy with, from its own decisions alone
(Dynamo's ActiveSequences: no polling). A request counts from the moment it is routed until it
finishes; until its first token its uncached prompt tokens are also queued prefill work.

As in Dynamo, a worker's active blocks are the distinct prompt blocks (by chained hash) of its
unfinished requests: a block that several of them share (a common system prompt, a session's
history under a subagent) is one block of KV there, counted once. `new_blocks` is what a request
would add to that: its blocks no unfinished request on the worker holds yet.

This file owns the prediction only: it never picks a worker and never talks to an instance.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from rackserve.router.index import WorkerKey


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


def uncached_prefill_blocks(num_tokens: int, overlap_blocks: int, block_size: int) -> float:
    """A request's queued prefill in blocks: its prompt tokens beyond the cached prefix (the
    partial last block included, as Dynamo counts tokens), over the block size."""
    return max(num_tokens - overlap_blocks * block_size, 0) / block_size if block_size else 0.0


class ActiveLoads:
    def __init__(self) -> None:
        self._loads: dict[WorkerKey, WorkerLoad] = {}
        self._refs: dict[WorkerKey, Counter[int]] = {}     # block hash -> unfinished requests holding it
        self._requests: dict[str, _Routed] = {}

    def get(self, worker: WorkerKey) -> WorkerLoad:
        return self._loads.get(worker) or WorkerLoad()

    def new_blocks(self, worker: WorkerKey, hashes: Sequence[int]) -> int:
        """Of a prompt's blocks, those no unfinished request on `worker` holds: what routing it
        there adds to the worker's active blocks."""
        refs = self._refs.get(worker)
        return len(hashes) if not refs else sum(1 for h in hashes if h not in refs)

    def add(self, request_id: str, worker: WorkerKey, hashes: Sequence[int], prefill_blocks: float) -> None:
        assert request_id not in self._requests, f"request {request_id} routed twice"
        self._requests[request_id] = _Routed(worker, tuple(hashes), prefill_blocks)
        load = self._loads.setdefault(worker, WorkerLoad())
        refs = self._refs.setdefault(worker, Counter())
        load.active_requests += 1
        load.prefill_blocks += prefill_blocks
        for block_hash in hashes:
            if refs[block_hash] == 0:
                load.active_blocks += 1
            refs[block_hash] += 1

    def first_token(self, request_id: str) -> None:
        routed = self._requests.get(request_id)
        if routed is not None and routed.prefilling:
            routed.prefilling = False
            load = self._loads[routed.worker]
            # max(): float sums may leave -1e-15 where the exact total is 0.
            load.prefill_blocks = max(load.prefill_blocks - routed.prefill_blocks, 0.0)

    def finish(self, request_id: str) -> None:
        """Idempotent: a retried or failed request may finish twice."""
        self.first_token(request_id)
        routed = self._requests.pop(request_id, None)
        if routed is None:
            return
        load, refs = self._loads[routed.worker], self._refs[routed.worker]
        load.active_requests -= 1
        for block_hash in routed.hashes:
            refs[block_hash] -= 1
            if refs[block_hash] == 0:
                del refs[block_hash]
                load.active_blocks -= 1

    def drop_worker(self, worker: WorkerKey) -> None:
        """Forget a worker that left the pool (its requests were failed or retried elsewhere)."""
        for request_id in [r for r, routed in self._requests.items() if routed.worker == worker]:
            self.finish(request_id)
        self._loads.pop(worker, None)
        self._refs.pop(worker, None)
