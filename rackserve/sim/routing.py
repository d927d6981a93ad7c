"""Routing between simulated instances (`--router-policy`): the cluster router's own policies
(router/policies.py: kv, prefix, least_load, round_robin) fed as the real router feeds them, and
`least_uncached`, which has no router equivalent. Under P/D the decode instances are picked as the
router picks its decode pool (router/disagg.py: policies.DecodeLoadPolicy, whatever `--router-policy`
names), and the policy picks the prefill instance.

For the router's policies a `ClusterRouter` keeps router/'s KVIndex and ActiveLoads: every step
of every simulated instance hands its DP ranks' KV events (the engine's own BlockPool events, with
events enabled as `--kv-events-config` would) to the index, and each routed request is counted in
the loads until its first token and its end, exactly as router/server.py counts it; the policy
then picks an instance and a DP rank (a worker), and the request is pinned to that rank as the
router pins it (`data_parallel_rank`). So a change to a router policy shows in the projection.
`least_uncached` reads each instance's prefix cache directly (perfect knowledge) and leaves the
DP rank to the engine's placement; `least_uncached_placement` is the same rule for the DP ranks
inside an instance (`--dp-placement`), beside the engine's own `least_load`.

This file owns the choice of instance and DP rank; it must never step an engine.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import islice, takewhile
from typing import Any, NamedTuple

from rackserve.core.hashing import block_hashes, extend_block_hashes
from rackserve.core.request import Request
from rackserve.core.scheduler import Scheduler
from rackserve.router.index import KVIndex, WorkerKey
from rackserve.router.load import ActiveLoads, uncached_prefill_blocks
from rackserve.router.policies import ROUTING_POLICIES, DecodeLoadPolicy, RoutingPolicy, create_policy

OWN_POLICIES = ("least_uncached",)


class Route(NamedTuple):
    instance: int
    dp_rank: int | None     # None: the engine's DP placement decides
    # The prompt's block hashes as the router computed them (core/hashing.py, seed 0, no salt,
    # `block_size` tokens a block): the engine takes them instead of hashing the prompt again.
    block_hashes: list[int] | None = None
    block_size: int = 0


class PromptHashes:
    """block_hashes of a session's prompts, each computed from the last one's where it extends it.

    An AgentX turn's prompt is the previous turn's plus a few blocks, and hashing a 100K-token
    prompt whole took ~1 ms of a 10 ms simulated step per request at rack scale. The memo is exact:
    it reuses the hashes of the leading whole blocks whose tokens equal the last prompt's under the
    same key (compared token by token), and a block's hash depends only on the tokens up to it. It
    keeps one prompt per key and the keys of one lane's play, so it holds about what the lanes do.
    """

    def __init__(self) -> None:
        self._plays: dict = {}      # lane -> (play, {session: (token_ids, hashes)})

    def of(self, token_ids: Sequence[int], block_size: int, seed: int = 0, key: tuple | None = None) -> list[int]:
        """block_hashes(token_ids, block_size, seed); `key`: (lane, play, session), or None."""
        if key is None:
            return block_hashes(token_ids, block_size, seed)
        lane, play, session = key
        kept = self._plays.get(lane)
        if kept is None or kept[0] != play:
            kept = self._plays[lane] = (play, {})
        last = kept[1].get((session, block_size, seed))
        same = _same_blocks(last[0], token_ids, block_size, len(last[1])) if last else 0
        hashes = extend_block_hashes(last[1][:same] if same else [], token_ids, block_size, seed)
        kept[1][(session, block_size, seed)] = (token_ids, hashes)
        return hashes


def _same_blocks(old: list[int], new: list[int], block_size: int, limit: int) -> int:
    """How many leading whole blocks (at most `limit`) `old` and `new` hold alike."""
    limit = min(limit, len(new) // block_size)
    end = limit * block_size
    if old[:end] == new[:end]:   # the usual case: the new prompt extends the old
        return limit
    lo, hi = 0, limit - 1        # the blocks alike are a prefix: the longest one, by halves
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if old[:mid * block_size] == new[:mid * block_size] else (lo, mid - 1)
    return lo


class SimRouter:
    """The base: picks a route; told of each instance's steps and of each request's first token
    and end (the router's view of the cluster). The hooks do nothing unless a router needs them.
    `pick`'s `key` names the prompt's session (lane, play, session) for PromptHashes."""
    uses_kv_events = False

    def __init__(self) -> None:
        self.prompt_hashes = PromptHashes()

    def pick(self, instances: Sequence, token_ids: Sequence[int], req_id: str, key: tuple | None = None) -> Route:
        raise NotImplementedError

    def observe(self, instance: int, kv_events_by_rank: list[list[Any]]) -> None:
        """KV events of one instance's step, one list per DP rank."""

    def first_token(self, req_id: str) -> None:
        """The request's first token arrived (its prefill is no longer queued work)."""

    def finish(self, req_id: str, output_tokens: int | None = None) -> None:
        """The request ended (or failed: no `output_tokens`)."""


class ClusterRouter(SimRouter):
    """router/policies.py's policy over router/'s KV index and predicted loads."""
    uses_kv_events = True

    def __init__(self, policy: str | RoutingPolicy, block_size: int, seed: int = 0, pin_dp_rank: bool = True,
                 clock: Callable[[], float] | None = None):
        """`policy`: a router policy's name, or the policy itself. `pin_dp_rank`: the request goes
        to the chosen worker's DP rank (as rackserve router pins `data_parallel_rank`); False: to its
        instance only, the engine placing it. `clock`: the virtual time, with which the loads learn
        kv's prices as the router's do (none: blocks)."""
        super().__init__()
        self.policy = create_policy(policy, seed=seed) if isinstance(policy, str) else policy
        self.block_size, self.pin_dp_rank = block_size, pin_dp_rank
        self.index, self.loads = KVIndex(block_size), ActiveLoads(clock)

    @staticmethod
    def worker(instance: int, dp_rank: int) -> WorkerKey:
        return WorkerKey(f"sim://{instance}", dp_rank)

    def pick(self, instances: Sequence, token_ids: Sequence[int], req_id: str, key: tuple | None = None) -> Route:
        hashes = self.prompt_hashes.of(token_ids, self.block_size, 0, key)
        workers = [self.worker(i, d) for i, inst in enumerate(instances) for d in range(len(inst.core.schedulers))]
        decision = self.policy.choose(hashes, workers, self.index, self.loads)
        # As router/server.py counts a routed request: its blocks, and the uncached ones as prefill.
        self.loads.add(req_id, decision.worker, hashes,
                       uncached_prefill_blocks(len(token_ids), decision.overlap_blocks, self.block_size))
        return Route(int(decision.worker.url.removeprefix("sim://")),
                     decision.worker.dp_rank if self.pin_dp_rank else None, hashes, self.block_size)

    def observe(self, instance: int, kv_events_by_rank: list[list[Any]]) -> None:
        for rank, events in enumerate(kv_events_by_rank):
            for event in events:
                self.index.apply(self.worker(instance, rank), event)

    def first_token(self, req_id: str) -> None:
        self.loads.first_token(req_id)

    def finish(self, req_id: str, output_tokens: int | None = None) -> None:
        self.loads.finish(req_id, output_tokens)


def uncached_work(scheduler: Scheduler, hashes: list[int], num_tokens: int) -> int:
    """Tokens a DP rank would compute for a prompt (whole cached blocks are free), plus the
    uncached tokens already queued or running there."""
    size = scheduler.block_size
    # The leading cached blocks, walked in C (the router probes every rank's cache for every prompt:
    # the busiest line of a rack-size run).
    cached = scheduler.kv.pool.cached.__contains__
    hit = size * len(list(takewhile(cached, islice(hashes, (num_tokens - 1) // size))))
    queued = sum(r.num_tokens - r.num_computed_tokens for r in (*scheduler.running, *scheduler.waiting))
    return queued + num_tokens - hit


def _hashes(scheduler: Scheduler, token_ids: Sequence[int], memo: PromptHashes | None = None,
            key: tuple | None = None) -> list[int]:
    """The prompt's block hashes as `scheduler` keys its cache (none without prefix caching),
    through a router's `memo` where it keeps one."""
    if not scheduler.kv.enable_caching:
        return []
    if memo is None:
        return block_hashes(token_ids, scheduler.block_size, scheduler.kv.hash_seed)
    return memo.of(token_ids, scheduler.block_size, scheduler.kv.hash_seed, key)


def least_uncached_placement(schedulers: Sequence[Scheduler], request: Request) -> int:
    """The DP rank with the least uncached work after taking `request` (lowest on a tie)."""
    hashes = _hashes(schedulers[0], request.all_token_ids)
    work = [uncached_work(s, hashes, request.num_tokens) for s in schedulers]
    return work.index(min(work))


DP_PLACEMENTS = {"least_uncached": least_uncached_placement}
DP_PLACEMENT_NAMES = ("router", "least_load", "least_uncached")   # router: the router's policy pins the rank


class LeastUncached(SimRouter):
    def pick(self, instances: Sequence, token_ids: Sequence[int], req_id: str, key: tuple | None = None) -> Route:
        scheduler = instances[0].core.schedulers[0]
        hashes = _hashes(scheduler, token_ids, self.prompt_hashes, key)   # one block size for all
        work = [min(uncached_work(s, hashes, len(token_ids)) for s in i.core.schedulers) for i in instances]
        return Route(work.index(min(work)), None, hashes if scheduler.kv.hash_seed == 0 and hashes else None,
                     scheduler.block_size)


def policy_names() -> list[str]:
    return sorted([*ROUTING_POLICIES, *OWN_POLICIES])


def make_router(name: str, block_size: int, seed: int = 0, pin_dp_rank: bool = True,
                clock: Callable[[], float] | None = None, decode_pool: bool = False) -> SimRouter:
    """The router of `--router-policy name`; `decode_pool`: the one for P/D's decode instances,
    which the router picks by load whatever its policy (least_uncached keeps its own rule)."""
    if name == "least_uncached":
        return LeastUncached()
    if name not in ROUTING_POLICIES:
        raise ValueError(f"unknown router policy {name!r}; known: {policy_names()}")
    return ClusterRouter(DecodeLoadPolicy(seed=seed) if decode_pool else name, block_size, seed, pin_dp_rank, clock)
