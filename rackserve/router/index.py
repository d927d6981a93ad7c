"""KVIndex: which (instance, DP rank) caches which block, rebuilt from the instances' KV events.

Block hashes are chained (core/hashing.py), so a hash names its whole prefix: a worker's cached
prefix of a prompt is the longest run of the prompt's leading block hashes it holds, and no tree
is needed (Dynamo's radix tree keys by a per-block local hash; ours are already cumulative).
A model whose cache comes in several groups (DeepSeek-V4) sends each prefix-cached group's events
with its `group_idx` and block size: a group block of k engine blocks is named by the hash of the
engine block that ends it, and the instance hits the prefix that every group holds, so a
worker's cached prefix is, cut group by group as the instance cuts it, k x the leading run of
every k-th prompt hash each group holds.
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
    def __init__(self, block_size: int | None = None) -> None:
        """`block_size`: the instances' engine block size (tokens), needed once a multi-group
        model's events arrive (the router sets it when the first instance joins)."""
        self.block_size = block_size
        self.blocks: dict[WorkerKey, set[int]] = {}      # worker -> hashes it caches
        self.owners: dict[int, set[WorkerKey]] = {}      # hash -> workers caching it
        # Multi-group workers: worker -> group_idx -> (engine blocks per group block, hashes held).
        self.groups: dict[WorkerKey, dict[int, tuple[int, set[int]]]] = {}

    def apply(self, worker: WorkerKey, event: Any) -> None:
        """One KV event (the wire structs of engine/kv_events.py or core's containers: both carry
        vLLM's class and field names)."""
        kind = type(event).__name__
        group = getattr(event, "group_idx", None)
        if kind == "BlockStored" and group is not None:
            self._group(worker, group, event.block_size)[1].update(event.block_hashes)
        elif kind == "BlockStored":
            self._add(worker, event.block_hashes)
        elif kind == "BlockRemoved" and group is not None:
            held = self.groups.get(worker, {}).get(group)
            if held is not None:
                held[1].difference_update(event.block_hashes)
        elif kind == "BlockRemoved":
            self._discard(worker, event.block_hashes)
        elif kind == "AllBlocksCleared":
            self.clear(worker)
        else:
            raise ValueError(f"unknown KV event {kind}")

    def _group(self, worker: WorkerKey, group: int, group_block_size: int) -> tuple[int, set[int]]:
        groups = self.groups.setdefault(worker, {})
        if group not in groups:
            if not self.block_size or group_block_size % self.block_size:
                raise ValueError(f"KV events of group {group} have blocks of {group_block_size} tokens, "
                                 f"not a multiple of the engine's {self.block_size}")
            groups[group] = (group_block_size // self.block_size, set())
        return groups[group]

    def clear(self, worker: WorkerKey) -> None:
        """Forget everything a worker caches (a reset, or it left the pool); it stays known."""
        self._discard(worker, list(self.blocks.get(worker, ())))
        self.blocks[worker] = set()
        self.groups.pop(worker, None)

    def remove_worker(self, worker: WorkerKey) -> None:
        self.clear(worker)
        del self.blocks[worker]
        assert worker not in self.groups

    def overlaps(self, hashes: Sequence[int]) -> dict[WorkerKey, int]:
        """Leading blocks of `hashes` each worker caches (workers caching none are absent)."""
        result = self._plain_overlaps(hashes)
        for worker, groups in self.groups.items():
            cached = len(hashes)
            for group in sorted(groups):   # as the instance cuts its hit: group by group, to whole blocks
                k, held = groups[group]
                cached = k * min(_run(hashes[k - 1::k], held), cached // k)
            if cached:
                result[worker] = cached
        return result

    def _plain_overlaps(self, hashes: Sequence[int]) -> dict[WorkerKey, int]:
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
            return len(self.blocks.get(worker, ())) + sum(len(h) for _, h in self.groups.get(worker, {}).values())
        return sum(self.num_blocks(w) for w in {*self.blocks, *self.groups})

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


def _run(hashes: Sequence[int], held: set[int]) -> int:
    """How many of `hashes`, from the first, are in `held`."""
    n = 0
    while n < len(hashes) and hashes[n] in held:
        n += 1
    return n
