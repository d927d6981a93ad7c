"""MooncakeConnector's worker half (the scheduler half and the protocol are in
mooncake_connector.py): owns Mooncake's transfer engine with the rank's KV cache registered, the
side channel server that answers peers (handshake, pin, done) and enforces leases, and the threads
that pull blocks from a producer. It never decides what to load or hold (the scheduler half does).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from rackserve.config import EngineConfig
from rackserve.kv_transfer.base import KVConnectorOutput, KVConnectorWorker
from rackserve.kv_transfer.fingerprint import kv_fingerprint
from rackserve.kv_transfer.kv_layout import KVLayout
from rackserve.kv_transfer.mooncake_connector import LoadOrder, MooncakeConnectorMetadata, side_channel_address
from rackserve.kv_transfer.side_channel import SideChannelClient, SideChannelPool, SideChannelServer


@dataclass
class _Hold:
    block_ids: list[int]
    deadline: float
    readers: int = 0


class MooncakeConnectorWorker(KVConnectorWorker):
    def __init__(self, config: EngineConfig, kv_cache: Any, tp_rank: int = 0, dp_rank: int = 0):
        super().__init__(config, kv_cache, tp_rank, dp_rank)
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise ImportError("MooncakeConnector needs Mooncake: pip install mooncake-transfer-engine-non-cuda "
                              "(and, without RDMA hardware, the libibverbs1 libnl-3-200 libnl-route-3-200 "
                              f"system packages): {e}") from e
        extra = config.kv_transfer.kv_connector_extra_config
        self.lease_seconds = float(extra.get("lease_seconds", 30.0))
        self.transfer_timeout = float(extra.get("transfer_timeout", 10.0))
        host, port = side_channel_address(config, dp_rank, tp_rank)
        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", extra.get("protocol", "tcp"), extra.get("device_name", "")):
            raise RuntimeError(f"Mooncake's transfer engine failed to start on {host}")
        # Every cache group's blocks, by address (one tensor, or one per group: kv_layout.py).
        self.kv_layout = KVLayout(kv_cache)
        for t in self.kv_layout.tensors:
            if self.engine.register_memory(t.data_ptr(), t.numel() * t.element_size()):
                raise RuntimeError("Mooncake could not register the KV cache memory")
        # A peer whose blocks we may read: same geometry, and the same weights (the fingerprint), so an
        # instance restarted with another model never feeds us its KV.
        self.layout = {"groups": self.kv_layout.describe(), "dtype": str(self.kv_layout.dtype),
                       "block_size": config.cache.block_size, "fingerprint": kv_fingerprint(config)}
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self._lock = threading.Lock()
        self._holds: dict[str, _Hold] = {}
        self._gone: deque[str] = deque(maxlen=10_000)   # released ids, so late readers stop retrying
        self._out = KVConnectorOutput()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-load")
        self._channels = SideChannelPool(self.transfer_timeout)   # kept open across pulls
        # Rank (d, r) serves on the instance's port + d * TP + r, and reads from the peer's TP
        # rank r of the DP rank its orders name (their port + r).
        self.server = SideChannelServer(host, port, self._handle)

    # -- producer -----------------------------------------------------------------------------
    def _handle(self, msg: dict) -> dict:
        op, req_id = msg.get("op"), msg.get("req_id")
        if op == "handshake":
            groups = self.kv_layout.groups
            return {"engine_id": self.config.kv_transfer.engine_id, "session": self.session,
                    "bases": [g.base for g in groups], "num_blocks": [g.num_blocks for g in groups], **self.layout}
        with self._lock:
            hold = self._holds.get(req_id)
            if op == "pin":
                if hold is None:
                    return {"status": "gone" if req_id in self._gone else "unknown"}
                hold.readers += 1
                hold.deadline = time.monotonic() + self.lease_seconds   # a reader renews the lease
                return {"status": "pinned", "block_ids": hold.block_ids}
            if op == "done":
                # A reader's done ends its pin; the blocks go when no reader is left, never while
                # another decoder given the same params still reads them. A done without a pin
                # (a decoder with nothing to read lets go) frees them only when nobody reads.
                if hold is not None:
                    if msg.get("pinned") and hold.readers > 0:
                        hold.readers -= 1
                    if hold.readers == 0:
                        self._release(req_id)
                return {"status": "released"}
        return {"error": f"unknown op {op!r}"}

    def _release(self, req_id: str) -> None:
        del self._holds[req_id]
        self._gone.append(req_id)
        self._out.finished_sending.add(req_id)

    # -- the step -----------------------------------------------------------------------------
    def start_load_kv(self, metadata: MooncakeConnectorMetadata | None) -> None:
        if metadata is None:
            return
        with self._lock:
            for req_id, tables in metadata.holds.items():
                self._holds[req_id] = _Hold([list(t) for t in tables], time.monotonic() + self.lease_seconds)
        for order in metadata.loads:
            self._pool.submit(self._load, order)

    def get_finished(self) -> KVConnectorOutput:
        now = time.monotonic()
        with self._lock:
            # The lease ran out with no reader; a reader that never said done (it died mid-read) gets
            # one more lease before its blocks go.
            for req_id in [r for r, h in self._holds.items()
                           if h.deadline < now and (h.readers == 0 or h.deadline + self.lease_seconds < now)]:
                self._release(req_id)
            out, self._out = self._out, KVConnectorOutput()
        return out

    # -- consumer (transfer threads) ----------------------------------------------------------
    def _load(self, order: LoadOrder) -> None:
        start = time.monotonic()
        ok = False
        try:
            with self._channels.connection(order.remote_host, order.remote_port + self.tp_rank) as client:
                ok = self._pull(client, order)
        except Exception:   # noqa: BLE001 - any failure is a failed load; the scheduler decides
            ok = False
        with self._lock:
            (self._out.finished_recving if ok else self._out.failed_recving).add(order.req_id)
            if ok and any(order.local_block_ids):
                stats = self._out.stats
                stats.blocks += sum(map(len, order.local_block_ids))
                stats.bytes += sum(len(ids) * g.block_bytes for ids, g in zip(order.local_block_ids,
                                                                               self.kv_layout.groups))
                stats.load_seconds.append(time.monotonic() - start)

    def _pull(self, client: SideChannelClient, order: LoadOrder) -> bool:
        if not any(order.local_block_ids):
            client.call({"op": "done", "req_id": order.remote_request_id})
            return True
        if client.peer is None:   # once per connection: a restarted producer is a new connection
            client.peer = client.call({"op": "handshake"})
        peer = client.peer
        if any(peer.get(k) != v for k, v in self.layout.items()):
            raise ValueError(f"the producer's KV layout {peer} differs from ours {self.layout}")
        deadline = time.monotonic() + self.transfer_timeout
        while True:   # the producer learns of its hold at its next step: it may not know it yet
            reply = client.call({"op": "pin", "req_id": order.remote_request_id})
            if reply["status"] == "pinned":
                break
            if reply["status"] == "gone" or time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        try:
            # The blocks we read must be ones the producer holds for this request.
            if any(not set(ids) <= set(held) for ids, held in zip(order.remote_block_ids, reply["block_ids"], strict=True)):
                return False
            local, remote, lengths = [], [], []
            for g, (local_ids, remote_ids) in enumerate(zip(order.local_block_ids, order.remote_block_ids)):
                ranges = self.kv_layout.ranges(g, local_ids, remote_ids, peer["bases"][g], peer["num_blocks"][g])
                for acc, part in zip((local, remote, lengths), ranges):
                    acc += part
            return self.engine.batch_transfer_sync_read(peer["session"], local, remote, lengths) == 0
        finally:
            client.call({"op": "done", "req_id": order.remote_request_id, "pinned": True})

    def shutdown(self) -> None:
        self.server.shutdown()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._channels.close()
