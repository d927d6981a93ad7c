"""What a caller gets back for a request: RequestOutput holding one CompletionOutput per sample,
shaped as vLLM's so code written for one runs on the other.

This file owns only these plain containers; it must never import torch.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int                           # 1 = the most likely token
    decoded_token: str | None = None


# One entry per generated token: token id -> Logprob, holding the sampled token and the top k.
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None    # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0          # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = field(default=None, repr=False)
    kv_transfer_params: dict | None = None   # where a decoder finds this request's KV (kv_transfer/)

    def add(self, delta: "RequestOutput") -> None:
        """Fold a later delta of the same request into this (cumulative) output."""
        assert delta.request_id == self.request_id
        by_index = {c.index: c for c in self.outputs}
        for new in delta.outputs:
            old = by_index.get(new.index)
            if old is None:
                self.outputs.append(copy.deepcopy(new))
                continue
            old.text += new.text
            old.token_ids.extend(new.token_ids)
            if new.logprobs is not None:
                # In place: a reader far behind folds thousands of deltas, a copy each would be quadratic.
                old.logprobs = old.logprobs if old.logprobs is not None else []
                old.logprobs.extend(new.logprobs)
                old.cumulative_logprob = (old.cumulative_logprob or 0.0) + (new.cumulative_logprob or 0.0)
            old.finish_reason, old.stop_reason = new.finish_reason, new.stop_reason
        self.outputs.sort(key=lambda c: c.index)
        self.finished = delta.finished
        self.num_cached_tokens = delta.num_cached_tokens
        self.kv_transfer_params = delta.kv_transfer_params or self.kv_transfer_params
