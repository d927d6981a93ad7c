"""Routing between simulated instances: a small base class and a registry by name
(`--router-policy`). `round_robin`, `least_load` (fewest requests in flight) and `least_uncached`
(least uncached prompt work, reading each instance's prefix cache as perfect KV events would) live
here until the cluster router (router/) exists; its policies will plug in through the same `pick`.
`least_uncached_placement` is the same rule for the DP ranks inside an instance
(`--dp-placement`), beside the engine's own `least_load`.

This file owns the choice of instance and DP rank; it must never step an engine.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Callable

from rackserve.core.hashing import block_hashes
from rackserve.core.request import Request
from rackserve.core.scheduler import Scheduler


class RoutingPolicy(ABC):
    @abstractmethod
    def pick(self, instances: Sequence, token_ids: list[int]) -> int:
        """The index of the instance that takes a request with these prompt tokens."""


ROUTING_POLICIES: dict[str, Callable[[], RoutingPolicy]] = {}


def register_policy(name: str):
    def wrap(cls):
        ROUTING_POLICIES[name] = cls
        return cls
    return wrap


@register_policy("round_robin")
class RoundRobin(RoutingPolicy):
    def __init__(self) -> None:
        self.next = 0

    def pick(self, instances: Sequence, token_ids: list[int]) -> int:
        index = self.next % len(instances)
        self.next += 1
        return index


@register_policy("least_load")
class LeastLoad(RoutingPolicy):
    def pick(self, instances: Sequence, token_ids: list[int]) -> int:
        loads = [i.load() for i in instances]
        return loads.index(min(loads))


def uncached_work(scheduler: Scheduler, hashes: list[int], num_tokens: int) -> int:
    """Tokens a DP rank would compute for a prompt (whole cached blocks are free), plus the
    uncached tokens already queued or running there."""
    pool, size = scheduler.kv.pool, scheduler.block_size
    hit = 0
    for h in hashes[:(num_tokens - 1) // size]:
        if pool.get_cached_block(h) is None:
            break
        hit += size
    queued = sum(r.num_tokens - r.num_computed_tokens for r in (*scheduler.running, *scheduler.waiting))
    return queued + num_tokens - hit


def _hashes(scheduler: Scheduler, token_ids: list[int]) -> list[int]:
    return block_hashes(token_ids, scheduler.block_size, scheduler.kv.hash_seed) if scheduler.kv.enable_caching else []


def least_uncached_placement(schedulers: Sequence[Scheduler], request: Request) -> int:
    """The DP rank with the least uncached work after taking `request` (lowest on a tie)."""
    hashes = _hashes(schedulers[0], request.all_token_ids)
    work = [uncached_work(s, hashes, request.num_tokens) for s in schedulers]
    return work.index(min(work))


DP_PLACEMENTS = {"least_uncached": least_uncached_placement}


@register_policy("least_uncached")
class LeastUncached(RoutingPolicy):
    def pick(self, instances: Sequence, token_ids: list[int]) -> int:
        hashes = _hashes(instances[0].core.schedulers[0], token_ids)   # one block size for all
        work = [min(uncached_work(s, hashes, len(token_ids)) for s in i.core.schedulers) for i in instances]
        return work.index(min(work))


def make_policy(name: str) -> RoutingPolicy:
    if name not in ROUTING_POLICIES:
        raise ValueError(f"unknown router policy {name!r}; known: {sorted(ROUTING_POLICIES)}")
    return ROUTING_POLICIES[name]()
