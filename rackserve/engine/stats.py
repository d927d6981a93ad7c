"""Engine statistics handed to stat loggers (Prometheus, progress displays) after every step:
the scheduler's SchedulerStats (core/stats.py) and IterationStats, what happened in one step
(tokens, and latencies of requests that produced their first or last token).

This file owns IterationStats and the StatLogger interface; it must never import HTTP or torch.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from rackserve.core.stats import SchedulerStats


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


class SpecDecodeCounts(StatLogger):
    """Speculative decoding's drafts added up from step to step (what /metrics counts as
    spec_decode_*): `llm.engine.stat_loggers.append(counts)`, then `counts.acceptance`."""

    def __init__(self):
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self.num_drafts += scheduler_stats.num_drafts
        self.num_draft_tokens += scheduler_stats.num_draft_tokens
        self.num_accepted_tokens += scheduler_stats.num_accepted_tokens

    @property
    def acceptance(self) -> float | None:
        """Kept drafts over computed ones; None before any draft."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None
