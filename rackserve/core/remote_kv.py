"""RemoteKV: the scheduler's requests whose KV crosses a KV connector (kv_transfer/).

It owns three sets: requests whose KV is arriving (WAITING_FOR_REMOTE_KVS, blocks allocated but
not in the prefix cache until the KV lands), requests back in the waiting queue with landed KV,
and finished requests whose blocks are held for a peer (until the workers report the peer done, or
its lease over). It never orders the queues or the batch (the Scheduler does) and never imports
torch.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from rackserve.core.hybrid_kv_cache_manager import HybridKVCacheManager
from rackserve.core.kv_cache_manager import KVCacheManager, PrefixHit
from rackserve.core.request import Request, RequestStatus
from rackserve.kv_transfer.base import KVConnectorOutput, KVConnectorScheduler


class LoadResults(NamedTuple):
    requeue: list[Request]     # to the front of the waiting queue: KV landed, or to recompute
    failed: list[Request]      # ended (kv_load_failure_policy "fail"): report them finished
    landed_tokens: int         # tokens that arrived, for external_prefix_cache_hits


class RemoteKV:
    def __init__(self, connector: KVConnectorScheduler, kv: KVCacheManager | HybridKVCacheManager,
                 load_failure_policy: str):
        self.connector = connector
        self.kv = kv
        self.load_failure_policy = load_failure_policy
        self.loading: dict[str, tuple[Request, int]] = {}   # request, tokens arriving
        self.landed: set[str] = set()
        self.sending: dict[str, Request] = {}
        self.grouped = isinstance(kv, HybridKVCacheManager)   # several cache groups: block ids per group

    def connector_block_ids(self, request: Request) -> list[int] | tuple[list[int | None], ...]:
        """What the connector is told a request holds: its table, or one per cache group."""
        return self.kv.transfer_block_ids(request) if self.grouped else self.kv.block_ids(request)

    def scheduled_block_ids(self, request: Request):
        """connector_block_ids for `request_scheduled`, every step of every scheduled request: a
        view of the table (KVCacheManager.block_id_view) where there is one table, not a new list."""
        return self.kv.transfer_block_ids(request) if self.grouped else self.kv.block_id_view(request)

    def has_transfers(self) -> bool:
        return bool(self.sending or self.loading)

    def has_pending_work(self) -> bool:
        """Loads in flight, or orders the workers still have to get."""
        return bool(self.loading) or self.connector.has_pending_orders()

    def start_load(self, request: Request, hit: PrefixHit, num_external: int) -> bool:
        """Give a request being admitted blocks for its hit plus `num_external` arriving tokens,
        kept out of the prefix cache until they land; False (nothing changed) if they do not fit."""
        if self.kv.allocate_slots(request, num_external, hit, delay_caching=True) is None:
            return False
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = hit.num_tokens
        self.loading[request.request_id] = (request, num_external)
        num_local = self.kv.hit_blocks(request) if self.grouped else len(hit.blocks)
        self.connector.update_state_after_alloc(request, self.connector_block_ids(request), num_local, num_external)
        return True

    def finish(self, request: Request) -> dict | None:
        """A request ended: free its blocks or hold them for a peer; the connector's params back."""
        hold, params = self.connector.request_finished(request, self.connector_block_ids(request))
        if hold:
            self.sending[request.request_id] = request
        else:
            self.kv.free(request)
        return params

    def update(self, out: KVConnectorOutput | Any) -> LoadResults:
        """Apply what the workers reported after a step."""
        self.connector.update_connector_output(out)
        for req_id in out.finished_sending:
            request = self.sending.pop(req_id, None)
            if request is not None:
                self.kv.free(request)
        results = LoadResults([], [], 0)
        for req_id in sorted(out.finished_recving | out.failed_recving):
            request, num_external = self.loading.pop(req_id, (None, 0))
            if request is None:
                continue
            if request.finished:   # aborted while its KV was arriving: now its blocks may go
                self.kv.free(request)
            elif req_id in out.finished_recving:
                request.num_computed_tokens += num_external
                request.num_cached_tokens = request.num_computed_tokens
                request.status = RequestStatus.WAITING
                self.landed.add(req_id)
                results.requeue.append(request)
                results = results._replace(landed_tokens=results.landed_tokens + num_external)
            elif self.load_failure_policy == "recompute":
                self.kv.free(request)
                request.num_computed_tokens = 0
                request.kv_transfer_params = None
                request.status = RequestStatus.WAITING
                results.requeue.append(request)
            else:
                self.kv.free(request)
                request.status = RequestStatus.FINISHED_ERROR
                request.stop_reason = "kv_load_failed"
                results.failed.append(request)
        return results
