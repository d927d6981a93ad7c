"""MooncakeConnector: point-to-point prefill/decode KV transfer over Mooncake's transfer engine.

The prefiller (a request with `kv_transfer_params: {"do_remote_decode": true}`) keeps the request's
blocks when it finishes and hands back where they are (engine id, request id, block ids, side
channel host and port). The decoder (`{"do_remote_prefill": true, ...those params}`) allocates
blocks for the prompt, pins the remote blocks over the side channel, reads them with one batched
transfer-engine read (TCP here, RDMA where there is hardware), says "done", and only then lets the
request run and its blocks be hit by others. The producer frees held blocks on "done", or when the
lease (`lease_seconds`, default 30) runs out with no reader, so a decoder that never comes leaks
nothing. The last prompt token is always computed on the decoder: it needs that position's logits.

The scheduler half is plain Python (no torch); the worker half owns the engine, the side channel
server and the transfer threads. Neither decides scheduling (the Scheduler does).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rackserve.config import EngineConfig
from rackserve.core.request import Request
from rackserve.kv_transfer.base import KVConnectorOutput, KVConnectorScheduler, KVConnectorWorker
from rackserve.kv_transfer.fingerprint import kv_fingerprint
from rackserve.kv_transfer.side_channel import SideChannelClient, SideChannelServer


@dataclass
class LoadOrder:
    req_id: str
    local_block_ids: list[int]          # empty: nothing to read, only release the producer's hold
    remote_block_ids: list[int]
    remote_host: str
    remote_port: int
    remote_request_id: str


@dataclass
class MooncakeConnectorMetadata:
    loads: list[LoadOrder] = field(default_factory=list)
    holds: dict[str, list[int]] = field(default_factory=dict)   # producer: req id -> its blocks


def side_channel_address(config: EngineConfig) -> tuple[str, int]:
    extra = config.kv_transfer.kv_connector_extra_config
    return extra.get("side_channel_host", "127.0.0.1"), int(extra["side_channel_port"])


class MooncakeConnectorScheduler(KVConnectorScheduler):
    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.block_size = config.cache.block_size
        self.host, self.port = side_channel_address(config)
        self.engine_id = self.transfer_config.engine_id
        self.is_producer = self.transfer_config.kv_role in ("kv_producer", "kv_both")
        self.is_consumer = self.transfer_config.kv_role in ("kv_consumer", "kv_both")
        self._meta = MooncakeConnectorMetadata()
        # (engine id, remote request id) already pulled or being pulled: one pull per prefill, so
        # the n samples of one prompt pull once and the others find it in the prefix cache.
        self._pulled: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._pending: dict[str, Request] = {}   # admitted this step, waiting for their blocks

    def _remote(self, request: Request) -> dict | None:
        params = request.kv_transfer_params
        if not self.is_consumer or not params or not params.get("do_remote_prefill"):
            return None
        missing = [k for k in ("remote_engine_id", "remote_request_id", "remote_block_ids",
                               "remote_host", "remote_port", "remote_num_tokens") if k not in params]
        if missing:
            raise ValueError(f"kv_transfer_params with do_remote_prefill lacks {missing}")
        return params

    def validate_request(self, request: Request) -> None:
        self._remote(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        params = self._remote(request)
        if params is None:
            return 0
        if (params["remote_engine_id"], params["remote_request_id"]) in self._pulled:
            return 0
        # Never the last prompt token: the decoder samples from its logits.
        n = min(int(params["remote_num_tokens"]), request.num_prompt_tokens - 1) - num_computed_tokens
        if n <= 0:   # all here already: only let the producer go
            self._mark_pulled(params)
            self._meta.loads.append(LoadOrder(request.request_id, [], [], params["remote_host"],
                                              int(params["remote_port"]), params["remote_request_id"]))
            return 0
        return n

    def _mark_pulled(self, params: dict) -> None:
        self._pulled[(params["remote_engine_id"], params["remote_request_id"])] = None
        if len(self._pulled) > 100_000:   # long past any lease: forget the oldest
            self._pulled.popitem(last=False)

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_local_blocks: int,
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        self._mark_pulled(params)
        end = -(-(request.num_computed_tokens + num_external_tokens) // self.block_size)
        remote = list(params["remote_block_ids"])
        if len(remote) < end:
            raise ValueError(f"kv_transfer_params name {len(remote)} remote blocks for {end} blocks of KV")
        self._meta.loads.append(LoadOrder(request.request_id, block_ids[num_local_blocks:end],
                                          remote[num_local_blocks:end], params["remote_host"],
                                          int(params["remote_port"]), params["remote_request_id"]))

    def build_connector_meta(self) -> MooncakeConnectorMetadata:
        meta, self._meta = self._meta, MooncakeConnectorMetadata()
        return meta

    def has_pending_orders(self) -> bool:
        return bool(self._meta.loads or self._meta.holds)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        params = request.kv_transfer_params
        if (not self.is_producer or not params or not params.get("do_remote_decode")
                or request.status.finish_reason == "abort" or not block_ids):
            return False, None
        self._meta.holds[request.request_id] = block_ids
        return True, {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_engine_id": self.engine_id, "remote_request_id": request.request_id,
                      "remote_block_ids": block_ids, "remote_host": self.host, "remote_port": self.port,
                      "remote_num_tokens": request.num_computed_tokens}


@dataclass
class _Hold:
    block_ids: list[int]
    deadline: float
    readers: int = 0


class MooncakeConnectorWorker(KVConnectorWorker):
    def __init__(self, config: EngineConfig, kv_cache: Any, tp_rank: int = 0):
        super().__init__(config, kv_cache, tp_rank)
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise ImportError("MooncakeConnector needs Mooncake: pip install mooncake-transfer-engine-non-cuda "
                              "(and, without RDMA hardware, the libibverbs1 libnl-3-200 libnl-route-3-200 "
                              f"system packages): {e}") from e
        extra = config.kv_transfer.kv_connector_extra_config
        self.lease_seconds = float(extra.get("lease_seconds", 30.0))
        self.transfer_timeout = float(extra.get("transfer_timeout", 10.0))
        host, port = side_channel_address(config)
        assert kv_cache.is_contiguous(), "addresses are computed over one contiguous KV cache tensor"
        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", extra.get("protocol", "tcp"), extra.get("device_name", "")):
            raise RuntimeError(f"Mooncake's transfer engine failed to start on {host}")
        self.base = kv_cache.data_ptr()
        if self.engine.register_memory(self.base, kv_cache.numel() * kv_cache.element_size()):
            raise RuntimeError("Mooncake could not register the KV cache memory")
        # [layers, K/V or latent, blocks, ...]: one block of one tensor of one layer is contiguous.
        self.num_layers, self.num_tensors, self.num_blocks = kv_cache.shape[:3]
        self.block_bytes = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
        # A peer whose blocks we may read: same geometry, and the same weights (the fingerprint), so an
        # instance restarted with another model never feeds us its KV.
        self.layout = {"num_layers": self.num_layers, "num_tensors": self.num_tensors,
                       "block_bytes": self.block_bytes, "dtype": str(kv_cache.dtype),
                       "block_size": config.cache.block_size, "fingerprint": kv_fingerprint(config)}
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self._lock = threading.Lock()
        self._holds: dict[str, _Hold] = {}
        self._gone: deque[str] = deque(maxlen=10_000)   # released ids, so late readers stop retrying
        self._out = KVConnectorOutput()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-load")
        # TP rank r serves on port + r, and reads from the peer's rank r there.
        self.server = SideChannelServer(host, port + tp_rank, self._handle)

    # -- producer -----------------------------------------------------------------------------
    def _handle(self, msg: dict) -> dict:
        op, req_id = msg.get("op"), msg.get("req_id")
        if op == "handshake":
            return {"engine_id": self.config.kv_transfer.engine_id, "session": self.session,
                    "base": self.base, "num_blocks": self.num_blocks, **self.layout}
        with self._lock:
            hold = self._holds.get(req_id)
            if op == "pin":
                if hold is None:
                    return {"status": "gone" if req_id in self._gone else "unknown"}
                hold.readers += 1
                hold.deadline = time.monotonic() + self.lease_seconds   # a reader renews the lease
                return {"status": "pinned", "block_ids": hold.block_ids}
            if op == "done":
                if hold is not None:
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
            for req_id, block_ids in metadata.holds.items():
                self._holds[req_id] = _Hold(list(block_ids), time.monotonic() + self.lease_seconds)
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
            client = SideChannelClient(order.remote_host, order.remote_port + self.tp_rank, self.transfer_timeout)
            try:
                ok = self._pull(client, order)
            finally:
                client.close()
        except Exception:   # noqa: BLE001 - any failure is a failed load; the scheduler decides
            ok = False
        with self._lock:
            (self._out.finished_recving if ok else self._out.failed_recving).add(order.req_id)
            if ok and order.local_block_ids:
                stats = self._out.stats
                stats.blocks += len(order.local_block_ids)
                stats.bytes += len(order.local_block_ids) * self.block_bytes * self.num_layers * self.num_tensors
                stats.load_seconds.append(time.monotonic() - start)

    def _pull(self, client: SideChannelClient, order: LoadOrder) -> bool:
        if not order.local_block_ids:
            client.call({"op": "done", "req_id": order.remote_request_id})
            return True
        peer = client.call({"op": "handshake"})
        if any(peer[k] != v for k, v in self.layout.items()):
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
            if reply["block_ids"][:len(order.remote_block_ids)] != order.remote_block_ids:
                return False
            local, remote, lengths = self._ranges(order.local_block_ids, order.remote_block_ids,
                                                  peer["base"], peer["num_blocks"])
            return self.engine.batch_transfer_sync_read(peer["session"], local, remote, lengths) == 0
        finally:
            client.call({"op": "done", "req_id": order.remote_request_id})

    def _ranges(self, local_ids: list[int], remote_ids: list[int], remote_base: int,
                remote_num_blocks: int) -> tuple[list[int], list[int], list[int]]:
        """(local address, remote address, bytes) for every layer and tensor, runs of consecutive
        block ids on both sides merged into one range."""
        runs: list[list[int]] = []   # [local first, remote first, count]
        for lb, rb in zip(local_ids, remote_ids):
            if runs and lb == runs[-1][0] + runs[-1][2] and rb == runs[-1][1] + runs[-1][2]:
                runs[-1][2] += 1
            else:
                runs.append([lb, rb, 1])
        local, remote, lengths = [], [], []
        bb = self.block_bytes
        for plane in range(self.num_layers * self.num_tensors):
            for lb, rb, count in runs:
                local.append(self.base + (plane * self.num_blocks + lb) * bb)
                remote.append(remote_base + (plane * remote_num_blocks + rb) * bb)
                lengths.append(count * bb)
        return local, remote, lengths

    def shutdown(self) -> None:
        self.server.shutdown()
        self._pool.shutdown(wait=True, cancel_futures=True)
