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


@dataclass
class OffloadingMetadata:
    loads: dict[str, list[tuple[int, int]]] = field(default_factory=dict)   # req id -> (hash, block id)
    stores: list[tuple[int, int]] = field(default_factory=list)             # (hash, block id)


class OffloadingConnectorScheduler(KVConnectorScheduler):
    def __init__(self, config: EngineConfig, dp_rank: int = 0):
        super().__init__(config, dp_rank)
        self.block_size = config.cache.block_size
        self.held: set[int] = set()             # hashes the tier holds, as last reported
        path = disk_dir(config, 0, dp_rank)
        if path and os.path.isdir(path):   # what a previous run alike left on disk
            self.held.update(disk_blocks(path))
        self._stored_upto: dict[str, int] = {}  # req id -> leading blocks already sent to the tier
        self._meta = OffloadingMetadata()
        self._queued: set[int] = set()

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        first, last = num_computed_tokens // self.block_size, (request.num_tokens - 1) // self.block_size
        n = 0
        for block_hash in request.block_hashes[first:last]:
            if block_hash not in self.held:
                break
            n += 1
        return n * self.block_size

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_local_blocks: int,
                                 num_external_tokens: int) -> None:
        end = num_local_blocks + num_external_tokens // self.block_size
        self._meta.loads[request.request_id] = list(zip(request.block_hashes[num_local_blocks:end],
                                                        block_ids[num_local_blocks:end]))
        self._stored_upto[request.request_id] = end   # what it loads, the tier has

    def request_scheduled(self, request: Request, block_ids: list[int]) -> None:
        full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        for i in range(self._stored_upto.get(request.request_id, 0), full):
            block_hash = request.block_hashes[i]
            if block_hash not in self.held and block_hash not in self._queued:
                self._queued.add(block_hash)
                self._meta.stores.append((block_hash, block_ids[i]))
        self._stored_upto[request.request_id] = full

    def build_connector_meta(self) -> OffloadingMetadata:
        meta, self._meta, self._queued = self._meta, OffloadingMetadata(), set()
        return meta

    def has_pending_orders(self) -> bool:
        return bool(self._meta.stores or self._meta.loads)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._stored_upto.pop(request.request_id, None)
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
    entries = sorted((e for e in os.scandir(path) if "." not in e.name), key=lambda e: e.stat().st_mtime)
    return [int(e.name, 16) for e in entries]


class OffloadingConnectorWorker(KVConnectorWorker):
    def __init__(self, config: EngineConfig, kv_cache: Any, tp_rank: int = 0, dp_rank: int = 0):
        super().__init__(config, kv_cache, tp_rank, dp_rank)
        import torch
        extra = config.kv_transfer.kv_connector_extra_config
        block = kv_cache[:, :, 0]   # [layers, K/V or latent, block_size, heads, head_size]
        self.block_shape, self.dtype = tuple(block.shape), block.dtype
        self.block_bytes = block.numel() * block.element_size()
        num_cpu = int(extra.get("cpu_bytes", 1 << 30)) // self.block_bytes
        self.host = torch.empty((num_cpu, *self.block_shape), dtype=self.dtype)
        self._free_slots = list(range(num_cpu))
        self._cpu: OrderedDict[int, int] = OrderedDict()   # hash -> host slot, least recently used first
        self._disk: OrderedDict[int, None] = OrderedDict()
        self.disk_dir = disk_dir(config, tp_rank, dp_rank)
        self.num_disk = 0
        self._out = KVConnectorOutput()
        if self.disk_dir:
            os.makedirs(self.disk_dir, exist_ok=True)
            self.num_disk = int(extra.get("disk_bytes", 8 << 30)) // self.block_bytes
            for block_hash in disk_blocks(self.disk_dir):   # a restart alike reuses them
                self._disk[block_hash] = None
            while len(self._disk) > self.num_disk:
                old, _ = self._disk.popitem(last=False)
                os.remove(self._path(old))
                self._out.removed_hashes.append(old)

    def _path(self, block_hash: int) -> str:
        return os.path.join(self.disk_dir, f"{block_hash:016x}")

    def start_load_kv(self, metadata: OffloadingMetadata | None) -> None:
        """Loads are host or file copies: done here, before the forward, reported this step."""
        import torch
        for req_id, pairs in (metadata.loads.items() if metadata else ()):
            start = time.monotonic()
            try:
                for block_hash, block_id in pairs:
                    if block_hash in self._cpu:
                        self._cpu.move_to_end(block_hash)
                        self.kv_cache[:, :, block_id].copy_(self.host[self._cpu[block_hash]])
                    else:
                        self._disk.move_to_end(block_hash)
                        data = torch.from_file(self._path(block_hash), size=self.block_bytes, dtype=torch.uint8)
                        self.kv_cache[:, :, block_id].copy_(data.view(self.dtype).view(self.block_shape))
                self._out.finished_recving.add(req_id)
                self._out.stats.blocks += len(pairs)
                self._out.stats.bytes += len(pairs) * self.block_bytes
                self._out.stats.load_seconds.append(time.monotonic() - start)
            except (OSError, RuntimeError, KeyError):   # a file gone from disk: recompute instead
                self._out.failed_recving.add(req_id)

    def save_kv(self, metadata: OffloadingMetadata | None) -> None:
        """After the forward: copy the step's new full blocks to host memory."""
        for block_hash, block_id in (metadata.stores if metadata else ()):
            if block_hash in self._cpu or block_hash in self._disk:
                continue
            start = time.monotonic()
            if not self._free_slots and not self._evict_host():
                continue   # no host tier at all
            slot = self._free_slots.pop()
            self.host[slot].copy_(self.kv_cache[:, :, block_id])
            self._cpu[block_hash] = slot
            self._out.stored_hashes.append(block_hash)
            self._out.stats.blocks += 1
            self._out.stats.bytes += self.block_bytes
            self._out.stats.store_seconds.append(time.monotonic() - start)
            self._out.stats.tier_bytes.update(zip(("cpu", "disk"), self.usage()))

    def _evict_host(self) -> bool:
        """Free the least recently used host slot, spilling its block to disk if there is one."""
        if not self._cpu:
            return False
        block_hash, slot = self._cpu.popitem(last=False)
        self._free_slots.append(slot)
        if self.num_disk == 0:
            self._out.removed_hashes.append(block_hash)
            return True
        if len(self._disk) >= self.num_disk:
            old, _ = self._disk.popitem(last=False)
            os.remove(self._path(old))
            self._out.removed_hashes.append(old)
        # Written under a temporary name first: a crash never leaves a torn block behind.
        tmp = self._path(block_hash) + ".tmp"
        import torch
        self.host[slot].reshape(-1).view(torch.uint8).numpy().tofile(tmp)
        os.replace(tmp, self._path(block_hash))
        self._disk[block_hash] = None
        return True

    def get_finished(self) -> KVConnectorOutput:
        out, self._out = self._out, KVConnectorOutput()
        return out

    def usage(self) -> tuple[int, int]:
        """(bytes held in host memory, bytes held on disk)."""
        return len(self._cpu) * self.block_bytes, len(self._disk) * self.block_bytes
