"""Routing policies: a small base class and a registry by name (`--policy`), each picking one
worker (an instance and DP rank) for a request from the index of what workers cache and the
router's predicted loads.

- kv (default), Dynamo's terms: prefill blocks = the request's uncached blocks + the worker's
  queued prefill (uncached prompt tokens / block size of its requests before their first token)
  and decode blocks = the worker's active blocks (distinct prompt blocks of its unfinished
  requests) + the request's blocks not among them (Dynamo's potential blocks: the load the worker
  would carry if it took the request). Priced, by default, in seconds: the request's predicted
  end-to-end time on the worker from the prices the router learned (pricing.py); with an
  `overlap_weight` (or before any price is learned, weight 1), Dynamo's rule in blocks:
  overlap_weight * prefill blocks + decode blocks. Lowest cost wins, ties go to the worker with
  the smaller index, then at random. A temperature > 0 samples with p ~ exp(-normalised cost / T).
- kv_prefill: kv's prefill term alone, the least uncached work (see KvPrefillPolicy).
- prefix, SGLang's cache-aware rule over an approximate per-worker LRU of the blocks routed there.
- least_load (fewest active requests) and round_robin: the baselines `kv` is measured against.
- DecodeLoadPolicy (no --policy name): how the router picks decode workers when it has P/D pools.

This file never talks to an instance and never changes the index or the loads.
"""
from __future__ import annotations

import json
import logging
import math
import random
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from typing import Callable, NamedTuple

from rackserve.router.index import KVIndex, WorkerKey
from rackserve.router.load import ActiveLoads
from rackserve.router.pricing import Price

logger = logging.getLogger(__name__)


class Decision(NamedTuple):
    worker: WorkerKey
    overlap_blocks: int          # of the prompt's blocks, those the policy expects cached there


class RoutingPolicy(ABC):
    name: str

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)

    @abstractmethod
    def choose(self, hashes: Sequence[int], workers: Sequence[WorkerKey], index: KVIndex,
               loads: ActiveLoads) -> Decision:
        """Pick one of `workers` (never empty) for a prompt whose full blocks hash to `hashes`.
        May update the policy's own state (what it routed where), nothing else."""


ROUTING_POLICIES: dict[str, Callable[..., RoutingPolicy]] = {}


def register_policy(cls):
    ROUTING_POLICIES[cls.name] = cls
    return cls


def create_policy(name: str, **options) -> RoutingPolicy:
    if name not in ROUTING_POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(ROUTING_POLICIES)}")
    return ROUTING_POLICIES[name](**options)


@register_policy
class KvPolicy(RoutingPolicy):
    name = "kv"

    def __init__(self, overlap_weight: float | None = None, temperature: float = 0.0,
                 seed: int | None = None) -> None:
        """`overlap_weight` None: price in learned seconds (Dynamo's weight 1 until learned)."""
        super().__init__(seed)
        self.overlap_weight, self.temperature = overlap_weight, temperature

    def prices(self, workers: Sequence[WorkerKey], loads: ActiveLoads) -> list[Price] | None:
        """Every worker's learned price, or None (the block rule) if a weight was given or some
        worker has no price yet: costs are compared, so they must all be in the same unit."""
        if self.overlap_weight is not None:
            return None
        prices = [loads.price(w) for w in workers]
        return None if None in prices else prices

    def costs(self, hashes: Sequence[int], workers: Sequence[WorkerKey], index: KVIndex,
              loads: ActiveLoads) -> tuple[list[float], dict[WorkerKey, int]]:
        overlaps = index.overlaps(hashes)
        prices, weight = self.prices(workers, loads), self.overlap_weight or 1.0
        costs = []
        for i, worker in enumerate(workers):
            prefill, decode = self.terms(hashes, worker, overlaps, loads)
            costs.append(prices[i].seconds(prefill, decode) if prices else weight * prefill + decode)
        return costs, overlaps

    @staticmethod
    def terms(hashes: Sequence[int], worker: WorkerKey, overlaps: dict[WorkerKey, int],
              loads: ActiveLoads) -> tuple[float, int]:
        """(prefill blocks, decode blocks) the worker would carry if it took the request. The
        request's partial last block is left out of its prefill: it is the same on every worker."""
        load = loads.get(worker)
        prefill = len(hashes) - overlaps.get(worker, 0) + load.prefill_blocks
        return prefill, load.active_blocks + loads.new_blocks(worker, hashes)

    def choose(self, hashes, workers, index, loads):
        costs, overlaps = self.costs(hashes, workers, index, loads)
        if self.temperature > 0:
            low, high = min(costs), max(costs)
            span = (high - low) or 1.0
            weights = [math.exp(-(c - low) / span / self.temperature) for c in costs]
            worker = self.rng.choices(list(workers), weights)[0]
        else:
            best = min(costs)
            tied = [w for w, c in zip(workers, costs) if c == best]
            smallest = min(index.num_blocks(w) for w in tied)
            worker = self.rng.choice([w for w in tied if index.num_blocks(w) == smallest])
        if logger.isEnabledFor(logging.DEBUG) and overlaps.get(worker, 0) < max(overlaps.get(w, 0) for w in workers):
            self._log_moved(hashes, workers, overlaps, loads, costs, worker)
        return Decision(worker, overlaps.get(worker, 0))

    def _log_moved(self, hashes, workers, overlaps, loads, costs, chosen) -> None:
        """One JSON line per request sent off the worker caching most of its prompt, with every
        candidate's cost terms (Dynamo logs its formula per worker the same way, at debug)."""
        prices = self.prices(workers, loads) or [None] * len(workers)
        terms = [{"worker": f"{w.url}#{w.dp_rank}", "cost": c, "cached_blocks": overlaps.get(w, 0),
                  "uncached_blocks": len(hashes) - overlaps.get(w, 0), "new_blocks": loads.new_blocks(w, hashes),
                  **vars(loads.get(w)), **({"price": vars(p)} if p else {})}
                 for w, c, p in zip(workers, costs, prices)]
        logger.debug("kv moved off cache: %s", json.dumps(
            {"prompt_blocks": len(hashes), "chosen": f"{chosen.url}#{chosen.dp_rank}", "workers": terms}))


@register_policy
class KvPrefillPolicy(KvPolicy):
    """The worker (and DP rank) with the least uncached work: the request's uncached blocks plus
    the worker's queued prefill, in blocks; kv's decode term left out. It is the rule the seeds
    name for the Vera Rubin routing A/B ("the worker and DP rank with the least uncached work").
    Where decode is MoE-bound (the seeds: DeepSeek-V4.1-Flash's DEP32 step is 7% longer at 855K
    context than at 128K, and "least-load balancing by request count per rank suffices for
    decode"), a worker's active KV blocks say little about its decode load; with contexts of
    100K+ tokens, kv's decode term, one block for one block, outweighs a session's cached prefix
    and moves the session off the rank that caches it."""
    name = "kv_prefill"

    def prices(self, workers, loads):
        return None     # blocks of prefill only: no seconds to weigh them against

    @staticmethod
    def terms(hashes, worker, overlaps, loads):
        prefill, _ = KvPolicy.terms(hashes, worker, overlaps, loads)
        return prefill, 0


@register_policy
class PrefixPolicy(RoutingPolicy):
    """SGLang's cache-aware routing: when loads are imbalanced (max - min active requests above
    balance_abs_threshold and max above balance_rel_threshold * min) the shortest queue wins;
    otherwise the worker whose routed-prefix tree matches best, if the match rate reaches
    cache_threshold, else the worker with the smallest tree. The tree is an approximate LRU of
    block hashes per worker (`capacity` blocks), fed by the router's own decisions."""
    name = "prefix"

    def __init__(self, cache_threshold: float = 0.5, balance_abs_threshold: int = 32,
                 balance_rel_threshold: float = 1.5, capacity: int = 1 << 16, seed: int | None = None) -> None:
        super().__init__(seed)
        self.cache_threshold, self.capacity = cache_threshold, capacity
        self.balance_abs_threshold, self.balance_rel_threshold = balance_abs_threshold, balance_rel_threshold
        self.trees: dict[WorkerKey, OrderedDict[int, None]] = {}

    def _match(self, worker: WorkerKey, hashes: Sequence[int]) -> int:
        tree = self.trees.get(worker, {})
        n = 0
        while n < len(hashes) and hashes[n] in tree:
            n += 1
        return n

    def choose(self, hashes, workers, index, loads):
        queues = [loads.get(w).active_requests for w in workers]
        matches = [self._match(w, hashes) for w in workers]
        if (max(queues) - min(queues) > self.balance_abs_threshold
                and max(queues) > self.balance_rel_threshold * min(queues)):
            i = queues.index(min(queues))
        elif hashes and max(matches) / len(hashes) >= self.cache_threshold:
            i = matches.index(max(matches))
        else:
            sizes = [len(self.trees.get(w, ())) for w in workers]
            i = sizes.index(min(sizes))
        worker = workers[i]
        tree = self.trees.setdefault(worker, OrderedDict())
        for block_hash in hashes:
            tree[block_hash] = None
            tree.move_to_end(block_hash)
        while len(tree) > self.capacity:
            tree.popitem(last=False)
        return Decision(worker, matches[i])


@register_policy
class LeastLoadPolicy(RoutingPolicy):
    name = "least_load"

    def choose(self, hashes, workers, index, loads):
        queues = [loads.get(w).active_requests for w in workers]
        worker = self.rng.choice([w for w, q in zip(workers, queues) if q == min(queues)])
        return Decision(worker, index.overlaps(hashes).get(worker, 0))


@register_policy
class RoundRobinPolicy(RoutingPolicy):
    name = "round_robin"

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(seed)
        self.next = 0

    def choose(self, hashes, workers, index, loads):
        worker = workers[self.next % len(workers)]
        self.next += 1
        return Decision(worker, index.overlaps(hashes).get(worker, 0))


class DecodeLoadPolicy(RoutingPolicy):
    """Decode workers by load: fewest decode blocks if it took the request (kv's decode term,
    Dynamo's decode router with no overlap credit), then fewest requests; ties go to the worker
    that caches more of the prompt (less to pull or recompute), then at random."""
    name = "decode_load"

    def choose(self, hashes, workers, index, loads):
        overlaps = index.overlaps(hashes)

        def key(w):
            load = loads.get(w)
            return load.active_blocks + loads.new_blocks(w, hashes), load.active_requests, -overlaps.get(w, 0)
        best = min(key(w) for w in workers)
        worker = self.rng.choice([w for w in workers if key(w) == best])
        return Decision(worker, overlaps.get(worker, 0))
