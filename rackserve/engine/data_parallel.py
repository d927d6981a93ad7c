"""Data parallelism in the engine core: which DP rank takes a new request (a placement policy), and
the instance's SchedulerStats made from its DP ranks' schedulers and the step's per-rank timings.

Placement is a small function of the ranks' schedulers and the request, so a better policy (the
router's least uncached work) replaces it without touching the step loop. This file never imports
torch and never changes a scheduler.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Callable

from rackserve.core.request import Request
from rackserve.core.scheduler import Scheduler
from rackserve.core.stats import DPRankStats, KVTransferStats, SchedulerStats, sum_expert_token_counts

# (every DP rank's scheduler, the new request) -> the DP rank that takes it.
DPPlacement = Callable[[Sequence[Scheduler], Request], int]


def least_load(schedulers: Sequence[Scheduler], request: Request) -> int:
    """The DP rank with the fewest requests running or waiting, the lowest on a tie: balance by
    request count, which suffices for decode (where KV capacity seldom limits the batch)."""
    loads = [len(s.running) + len(s.waiting) for s in schedulers]
    return loads.index(min(loads))


def merge_dp_stats(per_rank: Sequence[SchedulerStats], num_kv_blocks: Sequence[int],
                   busy_seconds: Sequence[float | None]) -> SchedulerStats:
    """Counts summed over the DP ranks, KV usage over all their blocks, and each rank's own part.

    The ranks step in lockstep, so a step lasts as long as the slowest rank's forward: a rank's
    idle time is the slowest rank's busy time minus its own (0 unless every rank measured)."""
    assert len(per_rank) == len(num_kv_blocks) == len(busy_seconds)
    measured = None not in busy_seconds
    slowest = max(busy_seconds) if measured else 0.0   # type: ignore[type-var]
    return SchedulerStats(
        num_running_reqs=sum(s.num_running_reqs for s in per_rank),
        num_waiting_reqs=sum(s.num_waiting_reqs for s in per_rank),
        kv_cache_usage=sum(s.kv_cache_usage * n for s, n in zip(per_rank, num_kv_blocks)) / sum(num_kv_blocks),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in per_rank),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in per_rank),
        external_prefix_cache_queries=sum(s.external_prefix_cache_queries for s in per_rank),
        external_prefix_cache_hits=sum(s.external_prefix_cache_hits for s in per_rank),
        kv_transfer=_sum_kv_transfer(s.kv_transfer for s in per_rank),
        num_preemptions=sum(s.num_preemptions for s in per_rank),
        num_drafts=sum(s.num_drafts for s in per_rank),
        num_draft_tokens=sum(s.num_draft_tokens for s in per_rank),
        num_accepted_tokens=sum(s.num_accepted_tokens for s in per_rank),
        expert_token_counts=sum_expert_token_counts(s.expert_token_counts for s in per_rank),
        dp_ranks=[DPRankStats(s.num_running_reqs, s.num_waiting_reqs, s.kv_cache_usage, busy,
                              slowest - busy if measured else 0.0,   # type: ignore[operator]
                              kv_events=s.kv_events)
                  for s, busy in zip(per_rank, busy_seconds)],
    )


def _sum_kv_transfer(parts) -> KVTransferStats:
    total = KVTransferStats()
    for part in parts:
        total.add(part)
    return total
