"""Engine statistics handed to stat loggers (Prometheus, progress displays) after every step.

SchedulerStats is a snapshot of the scheduler and KV cache; IterationStats holds what happened
in one step (tokens, and latencies of requests that produced their first or last token). This
file owns only the containers and the StatLogger interface; it must never import HTTP or torch.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0         # fraction of KV blocks in use, 0..1
    prefix_cache_queries: int = 0       # prompt tokens looked up in the prefix cache this step
    prefix_cache_hits: int = 0          # of which found cached
    num_preemptions: int = 0            # preemptions this step


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float                  # seconds from arrival to the last token
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    num_prompt_tokens: int = 0          # prompt tokens of requests that produced their first token
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


class StatLogger(ABC):
    @abstractmethod
    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        """Called from the engine's step loop after every step; must be quick and never raise."""
