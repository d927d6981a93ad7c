"""Scheduler statistics: a snapshot of the scheduler and its KV cache after a step (under data
parallelism: summed over the DP ranks' schedulers, with each DP rank's own part in `dp_ranks`).

This file owns only these plain containers; it must never import torch or anything above core/.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from rackserve.core.kv_events import KVCacheEvent


@dataclass
class DPRankStats:
    """One DP rank's scheduler, and its part of the step's lockstep time."""
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0         # fraction of its KV blocks in use, 0..1
    busy_seconds: float | None = None   # computing this step, collectives excluded; None: not measured
    idle_seconds: float = 0.0           # waiting this step for the slowest DP rank
    kv_events: list[KVCacheEvent] = field(default_factory=list)   # its KV cache's, since the last report


@dataclass
class KVTransferStats:
    """What a KV connector moved since the last report (kv_transfer/)."""
    blocks: int = 0                     # KV blocks loaded or stored
    bytes: int = 0
    load_seconds: list[float] = field(default_factory=list)    # one per load (a request's blocks)
    store_seconds: list[float] = field(default_factory=list)   # one per stored block
    tier_bytes: dict[str, int] = field(default_factory=dict)   # bytes a tier holds now, by tier

    def add(self, other: "KVTransferStats | None") -> None:
        if other is not None:
            self.blocks += other.blocks
            self.bytes += other.bytes
            self.load_seconds += other.load_seconds
            self.store_seconds += other.store_seconds
            self.tier_bytes.update(other.tier_bytes)

    @property
    def is_empty(self) -> bool:
        return not (self.blocks or self.load_seconds or self.store_seconds or self.tier_bytes)


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0         # fraction of KV blocks in use, 0..1
    prefix_cache_queries: int = 0       # prompt tokens looked up in the prefix cache this step
    prefix_cache_hits: int = 0          # of which found cached
    num_preemptions: int = 0            # preemptions this step
    external_prefix_cache_queries: int = 0   # prompt tokens asked of the KV connector this step
    external_prefix_cache_hits: int = 0      # of which it loads from elsewhere
    kv_transfer: KVTransferStats = field(default_factory=KVTransferStats)
    dp_ranks: list[DPRankStats] = field(default_factory=list)   # by DP rank; set by the engine core
    # MoE models: (token, expert) pairs routed to each global expert this step, summed over layers.
    expert_token_counts: list[int] | None = None
    # One scheduler's KV events since its last snapshot (merged stats carry them per DP rank).
    kv_events: list[KVCacheEvent] = field(default_factory=list)
    # Speculative decoding this step: requests that computed drafts, their drafts, the drafts kept.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


def sum_expert_token_counts(counts: Iterable[list[int] | None]) -> list[int] | None:
    """Expert counts of several steps or DP ranks added up per expert; None where all are None."""
    given = [c for c in counts if c is not None]
    return [sum(per_expert) for per_expert in zip(*given)] if given else None
