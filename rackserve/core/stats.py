"""Scheduler statistics: a snapshot of the scheduler and its KV cache after a step (under data
parallelism: summed over the DP ranks' schedulers, with each DP rank's own part in `dp_ranks`).

This file owns only these plain containers; it must never import torch or anything above core/.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class DPRankStats:
    """One DP rank's scheduler, and its part of the step's lockstep time."""
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0         # fraction of its KV blocks in use, 0..1
    busy_seconds: float | None = None   # computing this step, collectives excluded; None: not measured
    idle_seconds: float = 0.0           # waiting this step for the slowest DP rank


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0         # fraction of KV blocks in use, 0..1
    prefix_cache_queries: int = 0       # prompt tokens looked up in the prefix cache this step
    prefix_cache_hits: int = 0          # of which found cached
    num_preemptions: int = 0            # preemptions this step
    dp_ranks: list[DPRankStats] = field(default_factory=list)   # by DP rank; set by the engine core
    # MoE models: (token, expert) pairs routed to each global expert this step, summed over layers.
    expert_token_counts: list[int] | None = None


def sum_expert_token_counts(counts: Iterable[list[int] | None]) -> list[int] | None:
    """Expert counts of several steps or DP ranks added up per expert; None where all are None."""
    given = [c for c in counts if c is not None]
    return [sum(per_expert) for per_expert in zip(*given)] if given else None
