"""Request: the scheduler's view of one sequence (prompt + generated tokens + progress).

There are no phases: `num_computed_tokens` (tokens whose KV is in the cache) catches up to
`num_tokens`; whenever it does, the model samples one more token. This file owns the token-level
stop rules (EOS, stop token ids, max_tokens, max_model_len). It must never import torch.
"""
from __future__ import annotations

import enum
from array import array
from dataclasses import dataclass, field

from rackserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    WAITING_FOR_REMOTE_KVS = 3          # blocks allocated, KV arriving through a KV connector
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7                  # this request alone failed (e.g. sampling); the engine goes on

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "error"}.get(self)


@dataclass(eq=False)
class Request:
    request_id: str
    # A list, or an array (the simulator's prompts of 100K+ tokens: 4 bytes a token, not 8 and
    # more); all_token_ids takes the same kind.
    prompt_token_ids: "list[int] | array"
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    # Seconds on the engine's clock (real or virtual); the engine sets it, core never reads a clock.
    arrival_time: float = 0.0
    cache_salt: str | None = None       # isolates this request's prefix cache from others

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1         # prompt tokens hit in the prefix cache; -1 until scheduled
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    max_tokens: int = 0                 # resolved against max_model_len by the scheduler
    block_hashes: list[int] = field(default_factory=list)  # of full blocks, see core/hashing.py

    def __post_init__(self) -> None:
        assert self.prompt_token_ids, "a request needs at least one prompt token"
        ids = self.prompt_token_ids
        self.all_token_ids = array(ids.typecode, ids) if isinstance(ids, array) else list(ids)
        # Orders for the KV connector; cleared when a failed load falls back to recompute.
        self.kv_transfer_params: dict | None = self.sampling_params.kv_transfer_params

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> bool:
        """After a token was appended: set a finished status if it ends the request."""
        last = self.output_token_ids[-1]
        params = self.sampling_params
        if not params.ignore_eos and last in self.eos_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
        elif last in params.stop_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = last
        elif self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
        return self.finished
