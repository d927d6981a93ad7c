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
    local_block_ids: list[list[int]]    # per cache group; all empty: nothing to read, only release the hold
    remote_block_ids: list[list[int]]   # per cache group, pairwise with local_block_ids
    remote_host: str
    remote_port: int
    remote_request_id: str


@dataclass
class MooncakeConnectorMetadata:
    loads: list[LoadOrder] = field(default_factory=list)
    holds: dict[str, list[list[int | None]]] = field(default_factory=dict)   # producer: req id -> its blocks per group


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


def check_remote_params(params: dict, block_size: int, group_block_sizes: list[int] | None = None) -> None:
    """Raise ValueError unless `params` names a pull this connector can carry out (both sides
    have the same block size: the side channel's handshake checks the layout). A model with
    several cache groups (`group_block_sizes`, tokens per block of each) names one list of block
    ids per group, null where the producer holds none (a window group's blocks behind its window)."""
    missing = [k for k in _REMOTE_FIELDS if k not in params]
    if missing:
        raise ValueError(f"kv_transfer_params with do_remote_prefill lacks {missing}")
    for key, kind in _REMOTE_FIELDS.items():
        value = params[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"kv_transfer_params.{key} must be {kind.__name__}, got {type(value).__name__}")
    tables, sizes = [params["remote_block_ids"]], [block_size]
    if group_block_sizes is not None:
        tables, sizes = params["remote_block_ids"], group_block_sizes
        if len(tables) != len(sizes) or not all(isinstance(t, list) for t in tables):
            raise ValueError(f"kv_transfer_params.remote_block_ids must be {len(sizes)} lists, one per KV cache group")

    def block_id(b: object, may_be_none: bool) -> bool:
        return (b is None and may_be_none) or (isinstance(b, int) and not isinstance(b, bool) and b >= 0)
    if not all(block_id(b, group_block_sizes is not None) for t in tables for b in t):
        raise ValueError("kv_transfer_params.remote_block_ids must be non-negative integers")
    if not 0 < params["remote_port"] < 65536:
        raise ValueError(f"kv_transfer_params.remote_port {params['remote_port']} is not a TCP port")
    if params["remote_num_tokens"] < 0:
        raise ValueError("kv_transfer_params.remote_num_tokens must be >= 0")
    for table, size in zip(tables, sizes):
        if len(table) * size < params["remote_num_tokens"]:
            raise ValueError(f"kv_transfer_params name {len(table)} remote blocks, too few for "
                             f"remote_num_tokens={params['remote_num_tokens']} at block size {size}")


class MooncakeConnectorScheduler(KVConnectorScheduler):
    supports_kv_cache_groups = True   # moves every group's blocks (a window group: the ones it holds)

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

    def _group_block_sizes(self) -> list[int] | None:
        groups = self.kv_cache_config and self.kv_cache_config.groups
        return None if not groups else [g.block_size for g in groups]

    def _remote(self, request: Request) -> dict | None:
        params = request.kv_transfer_params
        if not self.is_consumer or not params or not params.get("do_remote_prefill"):
            return None
        check_remote_params(params, self.block_size, self._group_block_sizes())
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
        if n <= 0 or not self._window_held(params, num_computed_tokens + n):
            # All here already, or the producer no longer holds the window these tokens end with:
            # compute them here, and only let the producer go.
            self._mark_pulled(params)
            self._meta.loads.append(LoadOrder(request.request_id, [], [], params["remote_host"],
                                              int(params["remote_port"]), params["remote_request_id"]))
            return 0
        return n

    def _window_held(self, params: dict, num_tokens: int) -> bool:
        """With cache groups, the first (sliding) group's blocks that the next token reads (its last
        `sliding_window` tokens, as HybridKVCacheManager allocates them for a load) are held by the
        producer; it gives back blocks behind its window as it goes."""
        if self.kv_cache_config is None:
            return True
        window = self.kv_cache_config.groups[0]
        first = max(0, num_tokens - window.sliding_window) // window.block_size
        end = -(-num_tokens // window.block_size)
        return all(b is not None for b in params["remote_block_ids"][0][first:end])

    def _mark_pulled(self, params: dict) -> None:
        self._pulled[(params["remote_engine_id"], params["remote_request_id"])] = None
        if len(self._pulled) > 100_000:   # long past any lease: forget the oldest
            self._pulled.popitem(last=False)

    def update_state_after_alloc(self, request: Request, block_ids, num_local_blocks,
                                 num_external_tokens: int) -> None:
        """`block_ids` and `num_local_blocks`: one list and one count, or (several cache groups)
        one of each per group, None where a window group allocated no block."""
        params = request.kv_transfer_params
        self._mark_pulled(params)
        num_tokens = request.num_computed_tokens + num_external_tokens
        if self.kv_cache_config is None:
            tables, remotes, locals_, sizes = [block_ids], [params["remote_block_ids"]], [num_local_blocks], \
                [self.block_size]
        else:
            tables, remotes, locals_ = block_ids, params["remote_block_ids"], num_local_blocks
            sizes = self._group_block_sizes()
        local_ids, remote_ids = [], []
        for table, remote, first, size in zip(tables, remotes, locals_, sizes, strict=True):
            end = -(-num_tokens // size)
            if len(remote) < end:
                raise ValueError(f"kv_transfer_params name {len(remote)} remote blocks for {end} blocks of KV")
            pairs = [(table[i], remote[i]) for i in range(first, end) if table[i] is not None]
            assert all(r is not None for _, r in pairs), "checked by _window_held"
            local_ids.append([lb for lb, _ in pairs])
            remote_ids.append([rb for _, rb in pairs])
        self._meta.loads.append(LoadOrder(request.request_id, local_ids, remote_ids, params["remote_host"],
                                          int(params["remote_port"]), params["remote_request_id"]))

    def build_connector_meta(self) -> MooncakeConnectorMetadata:
        meta, self._meta = self._meta, MooncakeConnectorMetadata()
        return meta

    def has_pending_orders(self) -> bool:
        return bool(self._meta.loads or self._meta.holds)

    def request_finished(self, request: Request, block_ids) -> tuple[bool, dict | None]:
        """`block_ids`: the request's table, or one per cache group (None where a window group
        gave its block back): the params name them as they are."""
        params = request.kv_transfer_params
        tables = [block_ids] if self.kv_cache_config is None else list(block_ids)
        if (not self.is_producer or not params or not params.get("do_remote_decode")
                or request.status.finish_reason == "abort" or not any(tables)):
            return False, None
        self._meta.holds[request.request_id] = tables
        return True, {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_engine_id": self.engine_id, "remote_request_id": request.request_id,
                      "remote_block_ids": block_ids if self.kv_cache_config is None else tables,
                      "remote_host": self.host, "remote_port": self.port,
                      "remote_dp_rank": self.dp_rank, "remote_num_tokens": request.num_computed_tokens}
