"""MooncakeStoreConnector: a KV pool shared by every instance, on Mooncake's distributed store
(`rackserve kv-pool` starts its master; `kv_connector_extra_config.master_server_address` names it).

Blocks are stored under `rackserve@<KV fingerprint>@tp<rank>@<block hash>` (core/hashing.py and
kv_transfer/fingerprint.py), so a prefix any instance computed is a hit on every other that would
compute the same bytes, and never on one with another model. Full blocks are stored as they are
computed: the step copies them to host memory and a background thread puts them, so the step never
waits on the store. On admission the scheduler asks the store for the longest run of stored blocks
after the local prefix hit; the workers get them before the request runs. A pool that is gone or
a block evicted meanwhile is a miss or a failed load (recomputed by default), never wrong tokens.

The scheduler half keeps its own store client (lookups only, no torch); the worker half owns the
client that contributes memory to the pool and the transfer thread.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rackserve.config import EngineConfig
from rackserve.core.request import Request
from rackserve.kv_transfer.base import KVConnectorOutput, KVConnectorWorker
from rackserve.kv_transfer.fingerprint import kv_fingerprint
from rackserve.kv_transfer.kv_layout import KVLayout
from rackserve.kv_transfer.offloading_connector import OffloadingConnectorScheduler, OffloadingMetadata


def store_key(fingerprint: str, tp_rank: int, block_hash: int) -> str:
    return f"rackserve@{fingerprint}@tp{tp_rank}@{block_hash:016x}"


def open_store(config: EngineConfig, segment_bytes: int) -> Any:
    """A client of the pool named in kv_connector_extra_config, contributing `segment_bytes`."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise ImportError("MooncakeStoreConnector needs Mooncake: pip install mooncake-transfer-engine-non-cuda "
                          f"(see README, KV transfer): {e}") from e
    extra = config.kv_transfer.kv_connector_extra_config
    if "master_server_address" not in extra:
        raise ValueError("MooncakeStoreConnector needs kv_connector_extra_config.master_server_address "
                         "(what `rackserve kv-pool` prints)")
    store = MooncakeDistributedStore()
    status = store.setup(extra.get("local_hostname", "127.0.0.1"), extra.get("metadata_server", "P2PHANDSHAKE"),
                         segment_bytes, int(extra.get("local_buffer_size", 16 << 20)), extra.get("protocol", "tcp"),
                         extra.get("device_name", ""), extra["master_server_address"])
    if status != 0:
        raise RuntimeError(f"could not join the Mooncake pool at {extra['master_server_address']} (status {status})")
    return store


class MooncakeStoreConnectorScheduler(OffloadingConnectorScheduler):
    """Decides stores as the offloading tier does; looks hits up in the shared store."""

    def __init__(self, config: EngineConfig, dp_rank: int = 0, store: Any = None, fingerprint: str | None = None):
        """`store`: a client with Mooncake's `batch_is_exist` (default: one opened on the configured
        pool; the simulator passes its pool's); `fingerprint`: what keys the model's blocks."""
        super().__init__(config, dp_rank)
        self.fingerprint = fingerprint or kv_fingerprint(config)
        self.store = store if store is not None else open_store(config, 0)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        if self.group_blocks is not None:
            return self.group_blocks.hit_tokens(request, num_computed_tokens, self._exist)
        first, last = num_computed_tokens // self.block_size, (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes[first:last]
        if not hashes:
            return 0
        n = 0
        for exists in self._exist(hashes):
            if not exists:
                break
            n += 1
        return n * self.block_size

    def _exist(self, keys: list[int]) -> list[bool]:
        """Which keys the pool holds (1: stored; 0: not; -1: the pool did not answer, a miss too)."""
        if not keys:
            return []
        return [found == 1 for found in self.store.batch_is_exist([store_key(self.fingerprint, 0, k) for k in keys])]


class MooncakeStoreConnectorWorker(KVConnectorWorker):
    """Moves blocks without Python bytes: the KV cache and a staging buffer are registered with
    the store's client; gets land straight in the KV cache's blocks (one range per layer and
    tensor), puts go from the staging copy of a block (the step's blocks may be rewritten before
    the background put runs). A key's value is the block's (layer, tensor) planes in order."""

    def __init__(self, config: EngineConfig, kv_cache: Any, tp_rank: int = 0, dp_rank: int = 0):
        super().__init__(config, kv_cache, tp_rank, dp_rank)
        import torch
        extra = config.kv_transfer.kv_connector_extra_config
        self.store = open_store(config, int(extra.get("global_segment_size", 256 << 20)))
        self.fingerprint = kv_fingerprint(config)
        self.layout = KVLayout(kv_cache)   # one group, or one per cache group (kv_layout.py)
        self.block_bytes = [g.block_bytes for g in self.layout.groups]
        # Bounded staging for puts (`store_staging_bytes`): a burst beyond it is not pooled, and
        # the step never waits for room. A slot holds the largest group's block.
        slot_bytes = max(self.block_bytes)
        slots = max(1, int(extra.get("store_staging_bytes", 64 << 20)) // slot_bytes)
        self.staging = torch.empty((slots, slot_bytes), dtype=torch.uint8)
        self._free_slots = list(range(slots))
        for tensor in (*self.layout.tensors, self.staging):
            if self.store.register_buffer(tensor.data_ptr(), tensor.numel() * tensor.element_size()):
                raise RuntimeError("Mooncake's store could not register the KV cache or its staging buffer")
        self._lock = threading.Lock()
        self._out = KVConnectorOutput()
        # One thread: the store's client sees one call at a time, puts and gets in order.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-store")

    def _key(self, block_hash: int) -> str:
        return store_key(self.fingerprint, self.tp_rank, block_hash)

    def start_load_kv(self, metadata: OffloadingMetadata | None) -> None:
        for req_id, pairs in (metadata.loads.items() if metadata else ()):
            self._thread.submit(self._load, req_id, pairs)

    def _load(self, req_id: str, orders: list[tuple[int, int, int]]) -> None:
        start = time.monotonic()
        groups = self.layout.groups
        try:
            todo = list(orders)
            # Bytes read per key; less (evicted meanwhile) or negative (the pool is gone, or one
            # transfer of a large batch failed: -800 seen now and then over TCP here) is a miss.
            # A key that failed is asked again, twice at most, before the load counts as failed.
            for _ in range(3):
                got = self.store.batch_get_into_multi_buffers(
                    [self._key(k) for k, _, _ in todo], [groups[g].addresses(b) for _, b, g in todo],
                    [[groups[g].plane_bytes] * groups[g].num_planes for _, _, g in todo])
                todo = [order for order, n in zip(todo, got) if n != self.block_bytes[order[2]]]
                if not todo:
                    break
            ok = not todo
        except Exception:   # noqa: BLE001 - a failed load; the scheduler recomputes or fails it
            ok = False
        with self._lock:
            (self._out.finished_recving if ok else self._out.failed_recving).add(req_id)
            if ok:
                self._out.stats.blocks += len(orders)
                self._out.stats.bytes += sum(self.block_bytes[g] for _, _, g in orders)
                self._out.stats.load_seconds.append(time.monotonic() - start)

    def save_kv(self, metadata: OffloadingMetadata | None) -> None:
        """Copy the step's new full blocks to staging now (their blocks may be reused next step);
        put them from the store thread, in one batch."""
        staged = []
        for key, block_id, group in (metadata.stores if metadata else ()):
            with self._lock:
                if not self._free_slots:
                    break
                slot = self._free_slots.pop()
            block = self.layout.block(group, block_id)
            # The staging slot seen as the block's dtype and shape: one strided copy, planes in order.
            self.staging[slot, :self.block_bytes[group]].view(block.dtype).view(block.shape).copy_(block)
            staged.append((key, slot, self.block_bytes[group]))
        if staged:
            self._thread.submit(self._put, staged)

    def _put(self, staged: list[tuple[int, int, int]]) -> None:
        start = time.monotonic()
        base, slot_bytes = self.staging.data_ptr(), self.staging.shape[1]
        try:
            statuses = self.store.batch_put_from([self._key(k) for k, _, _ in staged],
                                                 [base + slot * slot_bytes for _, slot, _ in staged],
                                                 [n for _, _, n in staged])
        except Exception:   # noqa: BLE001 - a store that failed is a block not pooled, nothing worse
            statuses = [-1] * len(staged)
        with self._lock:
            self._free_slots.extend(slot for _, slot, _ in staged)
            stored = [(k, n) for (k, _, n), status in zip(staged, statuses) if status == 0]
            self._out.stored_hashes += [k for k, _ in stored]
            self._out.stats.blocks += len(stored)
            self._out.stats.bytes += sum(n for _, n in stored)
            if stored:
                self._out.stats.store_seconds.append(time.monotonic() - start)

    def get_finished(self) -> KVConnectorOutput:
        with self._lock:
            out, self._out = self._out, KVConnectorOutput()
        return out

    def wait_for_stores(self) -> None:
        """Block until every put so far is done (tests and benchmarks; the step never calls it)."""
        self._thread.submit(lambda: None).result()

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)
        self.store.close()
