"""MooncakeConnector: point-to-point prefill/decode KV transfer over Mooncake's transfer engine.

The prefiller (a request with `kv_transfer_params: {"do_remote_decode": true}`) keeps the request's
blocks when it finishes and hands back where they are (engine id, request id, block ids, side
channel host and port, and the DP rank that holds them: under data parallelism each DP rank has
its own KV cache and serves its own side channel, so host and port lead to that rank's workers).
The decoder (`{"do_remote_prefill": true, ...those params}`) allocates blocks for the prompt, pins the remote blocks over the side channel, reads them with one batched
transfer-engine read (TCP here, RDMA where there is hardware), says "done", and only then lets the
request run and its blocks be hit by others. The producer frees held blocks on "done", or when the
lease (`lease_seconds`, default 30) runs out with no reader, so a decoder that never comes leaks
nothing. The last prompt token is always computed on the decoder: it needs that position's logits.

The scheduler half (this file) is plain Python (no torch); the worker half (mooncake_worker.py)
owns the engine, the side channel server and the transfer threads. Neither decides scheduling
(the Scheduler does).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from rackserve.config import EngineConfig
from rackserve.core.request import Request
from rackserve.kv_transfer.base import KVConnectorScheduler


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


def side_channel_address(config: EngineConfig, dp_rank: int = 0, tp_rank: int = 0) -> tuple[str, int]:
    """Where the rank (dp_rank, tp_rank) serves its side channel: the instance's port plus the
    rank's global index (dp_rank * TP + tp_rank), on the address of the node that hosts it
    (`side_channel_hosts`, one per node, for instances over several machines; else
    `side_channel_host`)."""
    extra = config.kv_transfer.kv_connector_extra_config
    parallel = config.parallel
    rank = dp_rank * parallel.tensor_parallel_size + tp_rank
    hosts = extra.get("side_channel_hosts") or [extra.get("side_channel_host", "127.0.0.1")] * parallel.nnodes
    if len(hosts) != parallel.nnodes:
        raise ValueError(f"side_channel_hosts names {len(hosts)} nodes; the instance has nnodes={parallel.nnodes}")
    return hosts[rank // parallel.local_world_size], int(extra["side_channel_port"]) + rank


# What a decode request's `kv_transfer_params` must hold, and of which type. These come from the
# client (through the proxy or router), so each is checked before the scheduler or the transfer
# thread uses it: a wrong type must be one request's 400, never an engine failure.
_REMOTE_FIELDS = {"remote_engine_id": str, "remote_request_id": str, "remote_block_ids": list,
                  "remote_host": str, "remote_port": int, "remote_num_tokens": int}


def check_remote_params(params: dict, block_size: int) -> None:
    """Raise ValueError unless `params` names a pull this connector can carry out (both sides
    have the same block size: the side channel's handshake checks the layout)."""
    missing = [k for k in _REMOTE_FIELDS if k not in params]
    if missing:
        raise ValueError(f"kv_transfer_params with do_remote_prefill lacks {missing}")
    for key, kind in _REMOTE_FIELDS.items():
        value = params[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"kv_transfer_params.{key} must be {kind.__name__}, got {type(value).__name__}")
    if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in params["remote_block_ids"]):
        raise ValueError("kv_transfer_params.remote_block_ids must be non-negative integers")
    if not 0 < params["remote_port"] < 65536:
        raise ValueError(f"kv_transfer_params.remote_port {params['remote_port']} is not a TCP port")
    if params["remote_num_tokens"] < 0:
        raise ValueError("kv_transfer_params.remote_num_tokens must be >= 0")
    if len(params["remote_block_ids"]) * block_size < params["remote_num_tokens"]:
        raise ValueError(f"kv_transfer_params name {len(params['remote_block_ids'])} remote blocks, too few for "
                         f"remote_num_tokens={params['remote_num_tokens']} at block size {block_size}")


class MooncakeConnectorScheduler(KVConnectorScheduler):
    def __init__(self, config: EngineConfig, dp_rank: int = 0):
        super().__init__(config, dp_rank)
        self.block_size = config.cache.block_size
        # This DP rank's first TP rank: a decoder's TP rank r adds r (its peer rank's shard).
        self.host, self.port = side_channel_address(config, dp_rank)
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
        check_remote_params(params, self.block_size)
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
                      "remote_dp_rank": self.dp_rank, "remote_num_tokens": request.num_computed_tokens}
