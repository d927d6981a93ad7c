"""KVIndex: which (instance, DP rank) caches which block, rebuilt from the instances' KV events.

Block hashes are chained (core/hashing.py), so a hash names its whole prefix: a worker's cached
prefix of a prompt is the longest run of the prompt's leading block hashes it holds, and no tree
is needed (Dynamo's radix tree keys by a per-block local hash; ours are already cumulative).
This file owns the index only: it never opens a socket and never picks a worker.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple


class WorkerKey(NamedTuple):
    """One routing target: an instance (its URL) and one of its DP ranks."""
    url: str
    dp_rank: int


class KVIndex:
    def __init__(self) -> None:
        self.blocks: dict[WorkerKey, set[int]] = {}      # worker -> hashes it caches
        self.owners: dict[int, set[WorkerKey]] = {}      # hash -> workers caching it

    def apply(self, worker: WorkerKey, event: Any) -> None:
        """One KV event (the wire structs of engine/kv_events.py or core's containers: both carry
        vLLM's class and field names)."""
        kind = type(event).__name__
        if kind == "BlockStored":
            self._add(worker, event.block_hashes)
        elif kind == "BlockRemoved":
            self._discard(worker, event.block_hashes)
        elif kind == "AllBlocksCleared":
            self.clear(worker)
        else:
            raise ValueError(f"unknown KV event {kind}")

    def clear(self, worker: WorkerKey) -> None:
        """Forget everything a worker caches (a reset, or it left the pool); it stays known."""
        self._discard(worker, list(self.blocks.get(worker, ())))
        self.blocks[worker] = set()

    def remove_worker(self, worker: WorkerKey) -> None:
        self.clear(worker)
        del self.blocks[worker]

    def overlaps(self, hashes: Sequence[int]) -> dict[WorkerKey, int]:
        """Leading blocks of `hashes` each worker caches (workers caching none are absent)."""
        result: dict[WorkerKey, int] = {}
        live: set[WorkerKey] | None = None
        for depth, block_hash in enumerate(hashes, 1):
            holders = self.owners.get(block_hash, set())
            live = set(holders) if live is None else live & holders
            if not live:
                break
            for worker in live:
                result[worker] = depth
        return result

    def num_blocks(self, worker: WorkerKey | None = None) -> int:
        if worker is not None:
            return len(self.blocks.get(worker, ()))
        return sum(len(b) for b in self.blocks.values())

    def _add(self, worker: WorkerKey, hashes: Iterable[int]) -> None:
        mine = self.blocks.setdefault(worker, set())
        for block_hash in hashes:
            mine.add(block_hash)
            self.owners.setdefault(block_hash, set()).add(worker)

    def _discard(self, worker: WorkerKey, hashes: Iterable[int]) -> None:
        mine = self.blocks.get(worker, set())
        for block_hash in hashes:
            mine.discard(block_hash)
            holders = self.owners.get(block_hash)
            if holders is not None:
                holders.discard(worker)
                if not holders:
                    del self.owners[block_hash]
