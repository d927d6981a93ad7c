"""The KV connector interface: a scheduler-side half and a worker-side half (vLLM v1's split, made
small), what passes between them each step, and the registry by name (`kv_connector`).

The scheduler half lives beside the Scheduler, sees requests and block ids only, and must never
import torch: it decides which tokens come from elsewhere and which blocks to hold for a peer.
The worker half lives beside the KV cache tensors (one per rank, each moving its own shard) and
moves bytes, off the step's critical path. They talk only through `SchedulerOutput.
kv_connector_metadata` (scheduler -> workers) and `ModelRunnerOutput.kv_connector_output` (back),
so both cross process boundaries as plain picklable data.
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rackserve.config import EngineConfig
from rackserve.core.stats import KVTransferStats

if TYPE_CHECKING:
    from collections.abc import Sequence

    from rackserve.core.kv_cache_groups import KVCacheConfig
    from rackserve.core.request import Request


@dataclass
class KVConnectorOutput:
    """What the worker half reports after a step: requests whose transfers ended."""
    finished_sending: set[str] = field(default_factory=set)   # producer: blocks may be freed
    finished_recving: set[str] = field(default_factory=set)   # consumer: KV landed in the blocks
    failed_recving: set[str] = field(default_factory=set)     # consumer: the load failed
    stored_hashes: list[int] = field(default_factory=list)    # a tier now holds these blocks
    removed_hashes: list[int] = field(default_factory=list)   # ... and no longer these
    stats: KVTransferStats = field(default_factory=KVTransferStats)

    @property
    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.failed_recving
                    or self.stored_hashes or self.removed_hashes or not self.stats.is_empty)


class KVConnectorScheduler(ABC):
    """Scheduler side. Every method is called from the scheduler's thread, within one step.

    A model with several KV cache groups (core/kv_cache_groups.py) gives it `kv_cache_config`; then
    block ids come one list per group (None where a sliding group gave a block back). A connector
    that moves only one group says so with `supports_kv_cache_groups = False`, and is refused."""
    supports_kv_cache_groups = False

    def __init__(self, config: EngineConfig, dp_rank: int = 0):
        assert config.kv_transfer is not None
        self.config = config
        self.transfer_config = config.kv_transfer
        self.dp_rank = dp_rank   # the DP rank whose scheduler this is (each has its own KV cache)
        self.kv_cache_config: KVCacheConfig | None = None

    @classmethod
    def moves_kv_cache_groups(cls, config: EngineConfig) -> bool:
        return cls.supports_kv_cache_groups

    def set_kv_cache_config(self, kv_cache_config: KVCacheConfig | None) -> None:
        self.kv_cache_config = kv_cache_config

    def validate_request(self, request: "Request") -> None:
        """Raise ValueError for kv_transfer_params this connector cannot follow (before queueing)."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> int:
        """Tokens after the first `num_computed_tokens` (the local prefix hit) that this connector
        will load asynchronously for a request being admitted; 0: none, compute them here."""

    @abstractmethod
    def update_state_after_alloc(self, request: "Request", block_ids: list[int], num_local_blocks: int,
                                 num_external_tokens: int) -> None:
        """The request now holds `block_ids` (its whole table; the first `num_local_blocks` were a
        local hit): load the external tokens into the blocks after those."""

    @abstractmethod
    def build_connector_meta(self) -> Any:
        """The workers' orders for this step (picklable); resets what it reported."""

    def has_pending_orders(self) -> bool:
        """Orders the workers have not had yet (e.g. a hold a decoder is about to ask for): the
        engine takes one more step to deliver them even when no request is left."""
        return False

    def request_scheduled(self, request: "Request", block_ids: "Sequence[int]") -> None:
        """The request was scheduled; its num_computed_tokens already counts this step's tokens,
        whose KV is in `block_ids` once the step ran (to store it elsewhere). `block_ids` is a
        view of the request's table (core/kv_cache_manager.BlockIdView), or one list per cache
        group: copy what you keep."""

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        """What the workers reported after a step (before the scheduler acts on it)."""

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict | None]:
        """A request ended. Returns (hold its blocks until the workers report it in
        finished_sending, kv_transfer_params for the caller)."""
        return False, None

    def request_loaded(self, request_id: str) -> None:
        """The workers reported the request's load as finished or failed."""


class KVConnectorWorker(ABC):
    """Worker side, beside one rank's KV cache (its shard under TP: rank r moves only its own,
    to and from rank r of the peer; under DP each DP rank's workers move that DP rank's blocks).
    Called from the rank's step loop."""

    def __init__(self, config: EngineConfig, kv_cache: Any, tp_rank: int = 0, dp_rank: int = 0):
        self.config = config
        self.kv_cache = kv_cache
        self.tp_rank = tp_rank
        self.dp_rank = dp_rank

    @abstractmethod
    def start_load_kv(self, metadata: Any) -> None:
        """Start this step's orders before the forward pass; never block on a transfer."""

    def save_kv(self, metadata: Any) -> None:
        """After the forward pass: the step's new KV is in the cache (to store it elsewhere)."""

    @abstractmethod
    def get_finished(self) -> KVConnectorOutput:
        """Transfers that ended since the last call."""

    def shutdown(self) -> None:
        """Stop threads and servers; safe to call twice."""


# name -> (module, scheduler class, worker class; "module:class" for a half in a module of its own);
# modules are imported only when chosen, so the
# scheduler side never pulls in torch or a transfer library it does not use.
KV_CONNECTORS: dict[str, tuple[str, str, str]] = {
    "MooncakeConnector": ("rackserve.kv_transfer.mooncake_connector", "MooncakeConnectorScheduler",
                          "rackserve.kv_transfer.mooncake_worker:MooncakeConnectorWorker"),
    "OffloadingConnector": ("rackserve.kv_transfer.offloading_connector", "OffloadingConnectorScheduler",
                            "OffloadingConnectorWorker"),
    "MooncakeStoreConnector": ("rackserve.kv_transfer.mooncake_store_connector", "MooncakeStoreConnectorScheduler",
                               "MooncakeStoreConnectorWorker"),
    "MultiConnector": ("rackserve.kv_transfer.multi_connector", "MultiConnectorScheduler", "MultiConnectorWorker"),
}


def connector_class(config: EngineConfig, side: int) -> type:
    """The scheduler (side 1) or worker (side 2) class of the configured connector."""
    assert config.kv_transfer is not None
    name = config.kv_transfer.kv_connector
    if name not in KV_CONNECTORS:
        raise ValueError(f"unknown kv_connector {name!r}; known: {sorted(KV_CONNECTORS)}")
    module, name = KV_CONNECTORS[name][0], KV_CONNECTORS[name][side]
    if ":" in name:   # a half in a module of its own
        module, name = name.split(":")
    return getattr(importlib.import_module(module), name)


def check_kv_cache_groups(config: EngineConfig) -> None:
    """Raise ValueError if the configured connector cannot move a cache of several groups."""
    if config.kv_transfer is not None and not connector_class(config, 1).moves_kv_cache_groups(config):
        raise ValueError(f"{config.kv_transfer.kv_connector} moves one KV cache group; this model's cache has "
                         "several (a sliding window and compressed entries): run it without --kv-transfer-config")


def create_kv_connector_scheduler(config: EngineConfig, dp_rank: int = 0,
                                  kv_cache_config: KVCacheConfig | None = None) -> KVConnectorScheduler | None:
    """The scheduler half; `kv_cache_config`: the cache groups of a model with several."""
    if config.kv_transfer is None:
        return None
    if kv_cache_config is not None:
        check_kv_cache_groups(config)
    connector = connector_class(config, 1)(config, dp_rank)
    connector.set_kv_cache_config(kv_cache_config)
    return connector


def create_kv_connector_worker(config: EngineConfig, kv_cache: Any, tp_rank: int = 0,
                               dp_rank: int = 0) -> KVConnectorWorker | None:
    if config.kv_transfer is None:
        return None
    return connector_class(config, 2)(config, kv_cache, tp_rank, dp_rank)


class TPTransferReports:
    """On a TP group's first rank: a request's transfer has ended when every rank reported it
    (each moves its own shard), and failed if any rank's part failed. Tier contents follow the
    first rank (all ranks get the same orders); stats add up."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._seen: dict[tuple[str, str], list] = {}   # (kind, req id) -> [ranks reported, any failed]

    def combine(self, parts: list[KVConnectorOutput]) -> KVConnectorOutput:
        out = KVConnectorOutput(stored_hashes=parts[0].stored_hashes, removed_hashes=parts[0].removed_hashes)
        for part in parts:
            out.stats.add(part.stats)
            for kind, reqs, failed in (("send", part.finished_sending, False), ("recv", part.finished_recving, False),
                                       ("recv", part.failed_recving, True)):
                for req_id in reqs:
                    seen = self._seen.setdefault((kind, req_id), [0, False])
                    seen[0] += 1
                    seen[1] = seen[1] or failed
        for (kind, req_id), (count, failed) in list(self._seen.items()):
            if count == self.world_size:
                del self._seen[(kind, req_id)]
                target = out.finished_sending if kind == "send" else (
                    out.failed_recving if failed else out.finished_recving)
                target.add(req_id)
        return out
