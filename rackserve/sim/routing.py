"""Routing between simulated instances: a small base class and a registry by name
(`--router-policy`). `round_robin` and `least_load` (fewest requests in flight) live here until
the cluster router (router/) exists; its policies will plug in through the same `pick`.

This file owns the choice of instance; it must never step an engine.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Callable


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


def make_policy(name: str) -> RoutingPolicy:
    if name not in ROUTING_POLICIES:
        raise ValueError(f"unknown router policy {name!r}; known: {sorted(ROUTING_POLICIES)}")
    return ROUTING_POLICIES[name]()
