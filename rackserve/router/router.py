"""Router: the pool of instances behind one URL and the decision for each request.

An instance joins from its URL alone: GET /kv_events says its DP ranks, block size, tokenizer
and event endpoints, and one KVEventSubscriber per DP rank keeps the index current. Health
checks (GET /health) take an instance that dies or stops answering out of the pool, dropping
its index entries and predicted load, and let it back in once it answers again (its index is
rebuilt by replay); a request whose connection fails has its instance checked at once. `route`
tokenizes nothing: it hashes the prompt's token ids with the instances' scheme (core/hashing.py)
and asks the policy. This file never speaks OpenAI (the front in server.py does).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import NamedTuple
from urllib.parse import urlparse

import aiohttp

from rackserve.core.hashing import block_hashes
from rackserve.router import BOTH, DECODE, PREFILL
from rackserve.engine.kv_events import connectable
from rackserve.router.events import KVEventSubscriber
from rackserve.router.index import KVIndex, WorkerKey
from rackserve.router.load import ActiveLoads
from rackserve.router.metrics import RouterMetrics
from rackserve.router.policies import DecodeLoadPolicy, RoutingPolicy
from rackserve.serve.request_body import read_within

logger = logging.getLogger(__name__)
MAX_INFO_BYTES = 4 << 20   # a GET /kv_events answer; 4096 DP ranks' endpoints take well under 1 MiB


class Route(NamedTuple):
    worker: WorkerKey
    overlap_blocks: int          # of the prompt's blocks, those the policy expects cached there
    best_overlap_blocks: int     # the most any candidate worker caches (what load may cost)


@dataclass
class Instance:
    url: str
    role: str = BOTH
    info: dict = field(default_factory=dict)          # its GET /kv_events
    healthy: bool = False
    subscribers: list[KVEventSubscriber] = field(default_factory=list)
    # Set when it leaves the pool: requests waiting on it stop waiting (retried, or their stream
    # ends with an error) instead of hanging on an instance that stopped answering.
    gone: asyncio.Event = field(default_factory=asyncio.Event)
    probe: asyncio.Task | None = None                  # a health check a failed request started
    refusal: str | None = None                         # why its GET /kv_events kept it out, last time

    @property
    def workers(self) -> list[WorkerKey]:
        return [WorkerKey(self.url, rank) for rank in range(self.info.get("data_parallel_size", 1))]


class Router:
    def __init__(self, urls: list[str], policy: RoutingPolicy, health_interval_s: float = 1.0,
                 health_timeout_s: float = 5.0, worker_api_key: str | None = None,
                 prefill_urls: list[str] = (), decode_urls: list[str] = (), pd_threshold_tokens: int = 256) -> None:
        roles = [(u, BOTH) for u in urls] + [(u, PREFILL) for u in prefill_urls] + [(u, DECODE) for u in decode_urls]
        assert roles, "a router needs at least one instance"
        assert bool(prefill_urls) == bool(decode_urls), "prefill and decode pools come together"
        self.instances = {url.rstrip("/"): Instance(url.rstrip("/"), role) for url, role in roles}
        assert len(self.instances) == len(roles), "an instance is listed twice"
        self.policy = policy
        self.index = KVIndex()
        # With P/D pools: decode workers are picked by load, and a request is disaggregated only
        # when at least this many of its prompt tokens are not cached on its decode worker.
        self.decode_policy = DecodeLoadPolicy(seed=None)
        self.pd_threshold_tokens = pd_threshold_tokens
        self.loads = ActiveLoads(clock=time.monotonic)   # timed: the kv policy's prices learn from it
        self.metrics = RouterMetrics(policy.name)
        self.health_interval_s, self.health_timeout_s = health_interval_s, health_timeout_s
        self.block_size: int | None = None
        self.session: aiohttp.ClientSession | None = None
        # Instances started with --api-key: every call to them (discovery, requests) carries it.
        self.headers = {"Authorization": f"Bearer {worker_api_key}"} if worker_api_key else {}
        self._health_task: asyncio.Task | None = None

    async def start(self) -> None:
        # No cap on connections (aiohttp's default is 100): each stream holds one for its whole
        # length, and past the cap streams and health checks queued inside the router (an instance
        # then failed its checks and left the pool). The instances bound what they take
        # (--max-waiting-requests: a 429, retried elsewhere).
        self.session = aiohttp.ClientSession(headers=self.headers, connector=aiohttp.TCPConnector(limit=0))
        await asyncio.gather(*(self._join(i) for i in self.instances.values()))
        self._health_task = asyncio.ensure_future(self._health_loop())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        for instance in self.instances.values():
            if instance.probe is not None:
                instance.probe.cancel()
        for instance in self.instances.values():
            for sub in instance.subscribers:
                await sub.close()
        if self.session is not None:
            await self.session.close()

    @property
    def healthy(self) -> list[Instance]:
        return [i for i in self.instances.values() if i.healthy]

    @property
    def disaggregated(self) -> bool:
        return any(i.role != BOTH for i in self.instances.values())

    def workers(self, roles: tuple[str, ...] = (BOTH,), exclude: set[str] = frozenset()) -> list[WorkerKey]:
        """Workers of healthy instances with one of `roles`, not in `exclude`."""
        return [w for i in self.healthy if i.role in roles and i.url not in exclude for w in i.workers]

    def hashes(self, token_ids: list[int], cache_salt: str | None = None) -> list[int]:
        """The prompt's full blocks hashed as the instances hash them (the salt enters the first)."""
        return block_hashes(token_ids, self.block_size, salt=cache_salt) if self.block_size else []

    def route(self, token_ids: list[int], exclude: set[str] = frozenset(), cache_salt: str | None = None,
              roles: tuple[str, ...] = (BOTH,), policy: RoutingPolicy | None = None) -> Route | None:
        """The policy's pick among healthy workers with one of `roles`, of instances not in
        `exclude`; None if none."""
        workers = self.workers(roles, exclude)
        if not workers:
            return None
        hashes = self.hashes(token_ids, cache_salt)
        worker, overlap = (policy or self.policy).choose(hashes, workers, self.index, self.loads)
        overlaps = self.index.overlaps(hashes)
        return Route(worker, overlap, max((overlaps.get(w, 0) for w in workers), default=0))

    async def leave(self, instance: Instance, reason: str) -> None:
        if not instance.healthy:
            return
        logger.warning("router: %s leaves the pool: %s", instance.url, reason)
        instance.healthy = False
        instance.gone.set()
        subscribers, instance.subscribers = instance.subscribers, []
        for worker in instance.workers:
            if worker in self.index.blocks or worker in self.index.groups:
                self.index.remove_worker(worker)
            self.loads.drop_worker(worker)
        self._gauge()
        for sub in subscribers:
            await sub.close()

    def suspect(self, instance: Instance, reason: str) -> None:
        """A request's connection to `instance` failed (the request itself is retried elsewhere).
        The instance is health-checked at once and leaves the pool only if that fails too: a dead
        instance refuses the check as it refused the request, while one reset connection (say a
        keep-alive connection the instance closed just as it was reused) does not cost a healthy
        instance its index and its place until the next periodic check."""
        if instance.healthy and instance.probe is None:
            instance.probe = asyncio.ensure_future(self._probe(instance, reason))

    async def _probe(self, instance: Instance, reason: str) -> None:
        try:
            if not await self._answers(instance):
                await self.leave(instance, reason)
        finally:
            instance.probe = None

    async def _answers(self, instance: Instance) -> bool:
        try:
            timeout = aiohttp.ClientTimeout(total=self.health_timeout_s)
            async with self.session.get(f"{instance.url}/health", timeout=timeout) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def _join(self, instance: Instance) -> None:
        timeout = aiohttp.ClientTimeout(total=self.health_timeout_s)
        try:
            async with self.session.get(f"{instance.url}/health", timeout=timeout) as resp:
                if resp.status != 200:
                    return
            async with self.session.get(f"{instance.url}/kv_events", timeout=timeout) as resp:
                data = await read_within(resp.content.iter_chunked(1 << 16), MAX_INFO_BYTES, None,
                                         resp.content_length)
                if data is None:
                    refusal = f"GET /kv_events answered more than {MAX_INFO_BYTES} bytes"
                elif resp.status == 200:
                    info = json.loads(data)
                    refusal = info_refusal(info, self.block_size)
                else:   # e.g. 401: it was started with an --api-key the router was not given
                    refusal = f"HTTP {resp.status} to GET /kv_events: {data[:200].decode(errors='replace')}"
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, RecursionError):
            return
        if refusal is not None:
            if refusal != instance.refusal:   # said once, not at every health check
                logger.error("router: %s left out: %s", instance.url, refusal)
            instance.refusal = refusal
            return
        if self.block_size is None:
            self.block_size = self.index.block_size = info["block_size"]
        instance.info, instance.refusal = info, None
        if info.get("enable_kv_cache_events"):
            host = urlparse(instance.url).hostname or "127.0.0.1"
            replays = info["replay_endpoints"]
            for worker, endpoint, replay in zip(instance.workers, info["endpoints"], replays):
                self.index.clear(worker)
                instance.subscribers.append(KVEventSubscriber(
                    worker, connectable(endpoint, host), connectable(replay, host) if replay else None,
                    info["topic"] or "", self.index, self._counter(instance.url)))
        instance.healthy = True
        instance.gone = asyncio.Event()
        logger.info("router: %s joins the pool (%d DP ranks)", instance.url, len(instance.workers))
        self._gauge()

    def _counter(self, url: str):
        def on_batch(received: int, dropped: int) -> None:
            if received:
                self.metrics.events_received.labels(url).inc(received)
            if dropped:
                self.metrics.events_dropped.labels(url).inc(dropped)
        return on_batch

    def _gauge(self) -> None:
        self.metrics.healthy_instances.set(len(self.healthy))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            results = await asyncio.gather(*(self._check(i) for i in self.instances.values()), return_exceptions=True)
            for instance, result in zip(self.instances.values(), results):
                if isinstance(result, Exception):   # one instance's failure must not end every instance's checks
                    logger.error("router: checking %s failed: %r", instance.url, result)

    async def _check(self, instance: Instance) -> None:
        if not instance.healthy:
            await self._join(instance)
        elif not await self._answers(instance):
            await self.leave(instance, "health check failed")


MAX_DP_RANKS = 4096   # far past any instance; a bigger count is garbage that would cost every route


def info_refusal(info: object, block_size: int | None) -> str | None:
    """Why an instance's GET /kv_events answer cannot join the pool (it is not a rackserve
    instance's, it refused the router's key, it names another block size), or None. It comes from
    another process: checked here, so one bad answer leaves out that instance and nothing else."""
    if not isinstance(info, dict):
        return f"GET /kv_events answered {str(info)[:200]!r}, not a rackserve instance's description"

    def count(key: str, top: int) -> bool:
        value = info.get(key)
        return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= top
    if (not count("block_size", 1 << 20) or not count("data_parallel_size", MAX_DP_RANKS)
            or ("max_model_len" in info and not count("max_model_len", 1 << 40))):
        return (f"GET /kv_events names block_size={info.get('block_size')!r}, data_parallel_size="
                f"{info.get('data_parallel_size')!r}, max_model_len={info.get('max_model_len')!r}: "
                "not a rackserve instance's description")
    if not isinstance(info.get("tokenizer"), str):
        return "GET /kv_events names no tokenizer"
    if block_size is not None and info["block_size"] != block_size:
        return f"it has block size {info['block_size']}, the pool {block_size}"
    if info.get("enable_kv_cache_events"):
        endpoints, replays, n = info.get("endpoints"), info.get("replay_endpoints"), info["data_parallel_size"]
        if not (isinstance(endpoints, list) and isinstance(replays, list) and len(endpoints) == len(replays) == n
                and all(isinstance(e, str) for e in endpoints)
                and all(r is None or isinstance(r, str) for r in replays)
                and isinstance(info.get("topic"), (str, type(None)))):
            return "GET /kv_events names KV event endpoints that do not match its DP ranks"
    return None
