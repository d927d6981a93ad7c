"""OffloadingConnector: a local tier below the KV cache, host memory then a directory on disk, both
bounded (`kv_connector_extra_config`: `cpu_bytes`, `disk_path`, `disk_bytes`).

Every full block is copied to host memory once computed (write-through, keyed by its block hash
from core/hashing.py), so a block the KV cache evicts later is still found here; host memory
spills its least recently used blocks to disk, and disk drops its oldest. On admission the
longest run of tier blocks after the local prefix hit is loaded back, with identical bytes, so
identical tokens. Disk files live under a fingerprint of the model and KV layout: an instance
restarted with another model or dtype never reads the old ones; one restarted alike reuses them.

The worker half owns the tier and its bounds and reports what it holds; the scheduler half keeps
a mirror (one step behind, which is safe: a step's loads run before its stores can evict) and
never imports torch. Prefix caching must be on (the tier is keyed by block hashes).
"""
from __future__ import annotations

import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from rackserve.config import EngineConfig
from rackserve.core.request import Request
from rackserve.kv_transfer.base import KVConnectorOutput, KVConnectorScheduler, KVConnectorWorker
from rackserve.kv_transfer.fingerprint import kv_fingerprint
from rackserve.kv_transfer.group_blocks import GroupBlocks
from rackserve.kv_transfer.kv_layout import KVLayout


@dataclass
class OffloadingMetadata:
    """Orders as (key, block id, cache group): the key is the block hash (group 0 of a one-group
    model), or a group block's key (group_blocks.py)."""
    loads: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)   # req id -> orders
    stores: list[tuple[int, int, int]] = field(default_factory=list)


class OffloadingConnectorScheduler(KVConnectorScheduler):
    supports_kv_cache_groups = True   # every group's full blocks (group_blocks.py)

    def __init__(self, config: EngineConfig, dp_rank: int = 0):
        super().__init__(config, dp_rank)
        self.block_size = config.cache.block_size
        self.held: set[int] = set()             # hashes the tier holds, as last reported
        path = disk_dir(config, 0, dp_rank)
        if path and os.path.isdir(path):   # what a previous run alike left on disk
            self.held.update(disk_blocks(path))
        self._stored_upto: dict[str, int] = {}  # req id -> leading blocks already sent to the tier
        self._group_done: dict[str, list[int]] = {}   # ... per cache group, with several
        self._meta = OffloadingMetadata()
        self._queued: set[int] = set()
        self.group_blocks: GroupBlocks | None = None

    def set_kv_cache_config(self, kv_cache_config) -> None:
        super().set_kv_cache_config(kv_cache_config)
        if kv_cache_config is not None:
            self.group_blocks = GroupBlocks(kv_cache_config, self.block_size)
            path = disk_dir(self.config, 0, self.dp_rank)
            for g in range(1, len(kv_cache_config.groups)):   # each group's files (the first's are read above)
                if path and os.path.isdir(os.path.join(path, f"g{g}")):
                    self.held.update(disk_blocks(os.path.join(path, f"g{g}")))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        if self.group_blocks is not None:
            return self.group_blocks.hit_tokens(request, num_computed_tokens,
                                                lambda keys: [k in self.held for k in keys])
        first, last = num_computed_tokens // self.block_size, (request.num_tokens - 1) // self.block_size
        n = 0
        for block_hash in request.block_hashes[first:last]:
            if block_hash not in self.held:
                break
            n += 1
        return n * self.block_size

    def update_state_after_alloc(self, request: Request, block_ids, num_local_blocks,
                                 num_external_tokens: int) -> None:
        """`block_ids`, `num_local_blocks`: one table and count, or one per cache group."""
        if self.group_blocks is not None:
            num_tokens = request.num_computed_tokens + num_external_tokens
            self._meta.loads[request.request_id] = self.group_blocks.loads(request, block_ids, num_local_blocks,
                                                                           num_tokens)
            self._group_done[request.request_id] = [num_tokens // g.block_size for g in self.group_blocks.groups]
            return
        end = num_local_blocks + num_external_tokens // self.block_size
        self._meta.loads[request.request_id] = [(h, b, 0) for h, b in zip(request.block_hashes[num_local_blocks:end],
                                                                           block_ids[num_local_blocks:end])]
        self._stored_upto[request.request_id] = end   # what it loads, the tier has

    def request_scheduled(self, request: Request, block_ids) -> None:
        if self.group_blocks is not None:
            done = self._group_done.setdefault(request.request_id, [0] * len(self.group_blocks.groups))
            for key, block_id, group in self.group_blocks.stores(request, block_ids, done):
                if key not in self.held and key not in self._queued:
                    self._queued.add(key)
                    self._meta.stores.append((key, block_id, group))
            return
        full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        for i in range(self._stored_upto.get(request.request_id, 0), full):
            block_hash = request.block_hashes[i]
            if block_hash not in self.held and block_hash not in self._queued:
                self._queued.add(block_hash)
                self._meta.stores.append((block_hash, block_ids[i], 0))
        self._stored_upto[request.request_id] = full

    def build_connector_meta(self) -> OffloadingMetadata:
        meta, self._meta, self._queued = self._meta, OffloadingMetadata(), set()
        return meta

    def has_pending_orders(self) -> bool:
        return bool(self._meta.stores or self._meta.loads)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._stored_upto.pop(request.request_id, None)
        self._group_done.pop(request.request_id, None)
        return False, None

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        self.held |= set(out.stored_hashes)
        self.held -= set(out.removed_hashes)


def disk_dir(config: EngineConfig, tp_rank: int = 0, dp_rank: int = 0) -> str | None:
    """A rank's tier directory, under the KV fingerprint (kv_transfer/fingerprint.py). Each DP
    rank has a tier of its own (its scheduler mirrors what its tier holds): `dp<d>/` under DP."""
    path = config.kv_transfer.kv_connector_extra_config.get("disk_path")
    if not path:
        return None
    rank = f"dp{dp_rank}/tp{tp_rank}" if config.parallel.data_parallel_size > 1 else f"tp{tp_rank}"
    return os.path.join(path, kv_fingerprint(config), rank)


def disk_blocks(path: str) -> list[int]:
    """Hashes of the blocks stored under `path`, oldest first (files a crash cut short skipped)."""
    entries = sorted((e for e in os.scandir(path) if "." not in e.name and e.is_file()),
                     key=lambda e: e.stat().st_mtime)
    return [int(e.name, 16) for e in entries]


class OffloadingConnectorWorker(KVConnectorWorker):
    """The tier of one rank. With several cache groups each group has host slots and disk files
    of its own block size, as many blocks as each other group (the bounds cover them all)."""

    def __init__(self, config: EngineConfig, kv_cache: Any, tp_rank: int = 0, dp_rank: int = 0):
        super().__init__(config, kv_cache, tp_rank, dp_rank)
        import torch
        extra = config.kv_transfer.kv_connector_extra_config
        self.layout = KVLayout(kv_cache)
        groups = range(len(self.layout.groups))
        self.block_bytes = [g.block_bytes for g in self.layout.groups]
        num_cpu = int(extra.get("cpu_bytes", 1 << 30)) // sum(self.block_bytes)
        self.host = [torch.empty((num_cpu, *self.layout.block(g, 0).shape), dtype=self.layout.dtype) for g in groups]
        self._free_slots = [list(range(num_cpu)) for _ in groups]
        self._cpu: OrderedDict[int, tuple[int, int]] = OrderedDict()   # key -> (group, host slot), LRU first
        self._disk: OrderedDict[int, int] = OrderedDict()             # key -> group, oldest first
        self.disk_dir = disk_dir(config, tp_rank, dp_rank)
        self.num_disk = 0
        self._out = KVConnectorOutput()
        if self.disk_dir:
            self.num_disk = int(extra.get("disk_bytes", 8 << 30)) // sum(self.block_bytes)
            for g in groups:
                os.makedirs(self._dir(g), exist_ok=True)
                for key in disk_blocks(self._dir(g)):   # a restart alike reuses them
                    self._disk[key] = g
                while sum(1 for v in self._disk.values() if v == g) > self.num_disk:
                    self._drop_disk(g)

    def _dir(self, group: int) -> str:
        return self.disk_dir if group == 0 else os.path.join(self.disk_dir, f"g{group}")

    def _path(self, key: int, group: int = 0) -> str:
        return os.path.join(self._dir(group), f"{key:016x}")

    def _drop_disk(self, group: int) -> None:
        """Remove the group's oldest file."""
        old = next(k for k, g in self._disk.items() if g == group)
        del self._disk[old]
        os.remove(self._path(old, group))
        self._out.removed_hashes.append(old)

    def start_load_kv(self, metadata: OffloadingMetadata | None) -> None:
        """Loads are host or file copies: done here, before the forward, reported this step."""
        import torch
        for req_id, orders in (metadata.loads.items() if metadata else ()):
            start = time.monotonic()
            try:
                for key, block_id, group in orders:
                    target = self.layout.block(group, block_id)
                    if key in self._cpu:
                        self._cpu.move_to_end(key)
                        target.copy_(self.host[group][self._cpu[key][1]])
                    else:
                        self._disk.move_to_end(key)
                        data = torch.from_file(self._path(key, group), size=self.block_bytes[group], dtype=torch.uint8)
                        target.copy_(data.view(self.layout.dtype).view(target.shape))
                self._out.finished_recving.add(req_id)
                self._out.stats.blocks += len(orders)
                self._out.stats.bytes += sum(self.block_bytes[g] for _, _, g in orders)
                self._out.stats.load_seconds.append(time.monotonic() - start)
            except (OSError, RuntimeError, KeyError):   # a file gone from disk: recompute instead
                self._out.failed_recving.add(req_id)

    def save_kv(self, metadata: OffloadingMetadata | None) -> None:
        """After the forward: copy the step's new full blocks to host memory."""
        for key, block_id, group in (metadata.stores if metadata else ()):
            if key in self._cpu or key in self._disk:
                continue
            start = time.monotonic()
            if not self._free_slots[group] and not self._evict_host(group):
                continue   # no host tier at all
            slot = self._free_slots[group].pop()
            self.host[group][slot].copy_(self.layout.block(group, block_id))
            self._cpu[key] = (group, slot)
            self._out.stored_hashes.append(key)
            self._out.stats.blocks += 1
            self._out.stats.bytes += self.block_bytes[group]
            self._out.stats.store_seconds.append(time.monotonic() - start)
            self._out.stats.tier_bytes.update(zip(("cpu", "disk"), self.usage()))

    def _evict_host(self, group: int) -> bool:
        """Free the group's least recently used host slot, spilling its block to disk if there is one."""
        key = next((k for k, (g, _) in self._cpu.items() if g == group), None)
        if key is None:
            return False
        _, slot = self._cpu.pop(key)
        self._free_slots[group].append(slot)
        if self.num_disk == 0:
            self._out.removed_hashes.append(key)
            return True
        if sum(1 for g in self._disk.values() if g == group) >= self.num_disk:
            self._drop_disk(group)
        # Written under a temporary name first: a crash never leaves a torn block behind.
        tmp = self._path(key, group) + ".tmp"
        import torch
        self.host[group][slot].reshape(-1).view(torch.uint8).numpy().tofile(tmp)
        os.replace(tmp, self._path(key, group))
        self._disk[key] = group
        return True

    def get_finished(self) -> KVConnectorOutput:
        out, self._out = self._out, KVConnectorOutput()
        return out

    def usage(self) -> tuple[int, int]:
        """(bytes held in host memory, bytes held on disk)."""
        return (sum(self.block_bytes[g] for g, _ in self._cpu.values()),
                sum(self.block_bytes[g] for g in self._disk.values()))
