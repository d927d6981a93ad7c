"""The KV pool through the engine's own store connector, on virtual time: each colocated instance
runs MooncakeStoreConnector's scheduler half (kv_transfer/mooncake_store_connector.py, torch-free),
which asks the pool for the longest run of stored blocks after the local prefix hit, admits the
request with those tokens as external (so they take no token budget and no compute) and orders
their load, then orders every full block the steps compute stored. Its store client is `SimStore`,
the pool's index (sim/kv_pool.py); this file's `SimStoreTransfer` carries the orders out as the
worker half would: a load of n blocks takes their KV bytes / the pool's bandwidth on the DP
rank's link (loads queue there), reported in `finished_recving` after the step during which it
ends; stored blocks join the pool at the end of the step that computed them.

It owns the simulated store client and the pool's worker half; it must never schedule, price
compute, sleep nor read any clock but the virtual one it is handed.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

from rackserve.config import EngineConfig, KVTransferConfig
from rackserve.kv_transfer.base import KV_CONNECTORS, KVConnectorOutput
from rackserve.kv_transfer.multi_connector import MultiKVConnectorOutput
from rackserve.kv_transfer.mooncake_store_connector import MooncakeStoreConnectorScheduler
from rackserve.kv_transfer.offloading_connector import OffloadingMetadata
from rackserve.sim.kv_pool import KVPool
from rackserve.sim.transfer import POLL_SECONDS, TransferRecord, split_landed

CONNECTOR = "SimMooncakeStoreConnector"
_POOLS: dict[str, "SimStore"] = {}      # master_server_address -> the store, as Mooncake's master names one
_names = itertools.count()


class SimStore:
    """The store client's lookup, over the pool's index: a block exists when the pool holds its
    hash."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.address = f"sim://kv-pool-{next(_names)}"
        _POOLS[self.address] = self

    def exist(self, hashes: list[int]) -> list[bool]:
        found = self.pool.prefix_tokens(hashes, len(hashes) * self.pool.block_size) // self.pool.block_size
        return [True] * found + [False] * (len(hashes) - found)

    def close(self) -> None:
        _POOLS.pop(self.address, None)


class SimStoreConnectorScheduler(MooncakeStoreConnectorScheduler):
    """MooncakeStoreConnector's scheduler half, its store client the simulated pool's."""

    def __init__(self, config: EngineConfig, dp_rank: int = 0):
        # One model per simulation: every instance computes the same bytes, keyed alike.
        super().__init__(config, dp_rank, store=_POOLS[config.kv_transfer.kv_connector_extra_config[
            "master_server_address"]], fingerprint="sim")

    def _exist(self, keys: list[int]) -> list[bool]:
        """The pool asked by block hash: the real client's keys (store_key) add only a prefix that is
        the same for every block of one simulation, and making and parsing a string per block was
        most of a pooled run's time in long prompts."""
        return self.store.exist(keys)


# The scheduler half only: SimStoreTransfer is the worker half, handed to the SimExecutor.
KV_CONNECTORS[CONNECTOR] = (__name__, "SimStoreConnectorScheduler", "")


def with_store(config: EngineConfig, store: SimStore) -> EngineConfig:
    """An instance's config with the store connector on the simulated pool; beside a P/D
    instance's own connector, both under MultiConnector (its pulls first), as vLLM composes them."""
    extra = {"master_server_address": store.address}
    kv = config.kv_transfer
    if kv is None:
        return dataclasses.replace(config, kv_transfer=KVTransferConfig(CONNECTOR, "kv_both", extra))
    children = [{"kv_connector": kv.kv_connector, "kv_connector_extra_config": kv.kv_connector_extra_config},
                {"kv_connector": CONNECTOR, "kv_connector_extra_config": extra}]
    return dataclasses.replace(config, kv_transfer=dataclasses.replace(
        kv, kv_connector="MultiConnector", kv_connector_extra_config={"connectors": children}))


class SimStoreTransfer:
    """One instance's store connector workers (one link to the pool a DP rank)."""

    def __init__(self, store: SimStore, kv_bytes: Callable[[int], float], num_dp_ranks: int,
                 clock: Callable[[], float], record: TransferRecord):
        self.store, self.kv_bytes, self.clock, self.record = store, kv_bytes, clock, record
        self.link_free = [0.0] * num_dp_ranks
        self.loading: list[list[tuple[float, str]]] = [[] for _ in range(num_dp_ranks)]
        self.stored: list[list[int]] = [[] for _ in range(num_dp_ranks)]

    def start(self, dp_rank: int, metadata: OffloadingMetadata | None) -> None:
        if metadata is None:
            return
        pool, now = self.store.pool, self.clock()
        for req_id, orders in metadata.loads.items():
            tokens = len(orders) * pool.block_size
            nbytes = self.kv_bytes(tokens) if tokens else 0.0
            begin = max(now, self.link_free[dp_rank])
            end = self.link_free[dp_rank] = begin + nbytes / pool.bandwidth
            self.loading[dp_rank].append((end, req_id))
            pool.hit_tokens += tokens
            r = self.record
            r.loads, r.blocks, r.bytes, r.seconds = r.loads + 1, r.blocks + len(orders), r.bytes + nbytes, \
                r.seconds + end - begin
        self.stored[dp_rank] += [key for key, _, _ in metadata.stores]

    def finished(self, dp_rank: int, step_end: float) -> KVConnectorOutput:
        """Loads that ended by the step's end; the blocks it computed, now in the pool."""
        out = KVConnectorOutput()
        out.finished_recving, self.loading[dp_rank] = split_landed(self.loading[dp_rank], step_end)
        if self.stored[dp_rank]:
            self.store.pool.offer(self.stored[dp_rank])
            out.stored_hashes, self.stored[dp_rank] = self.stored[dp_rank], []
        return out

    def next_event(self, now: float) -> float:
        ahead = [end - now for rank in self.loading for end, _ in rank if end > now]
        return min(ahead) if ahead else POLL_SECONDS


class SimMultiTransfer:
    """MultiConnector's worker half: each child transfer gets its own orders and reports."""

    def __init__(self, children: list):
        self.children = children
        self.clock = children[0].clock

    def start(self, dp_rank: int, metadata: list | None) -> None:
        for child, meta in zip(self.children, metadata or [None] * len(self.children)):
            child.start(dp_rank, meta)

    def finished(self, dp_rank: int, step_end: float) -> MultiKVConnectorOutput:
        parts = [child.finished(dp_rank, step_end) for child in self.children]
        out = MultiKVConnectorOutput(parts=parts)
        for part in parts:
            out.finished_sending |= part.finished_sending
            out.finished_recving |= part.finished_recving
        return out

    def next_event(self, now: float) -> float:
        return min(child.next_event(now) for child in self.children)
