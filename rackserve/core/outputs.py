"""The step contract: what the scheduler hands the executor (SchedulerOutput), what the executor
hands back (ModelRunnerOutput), and what the engine core reports per request (EngineCoreOutput).

These are plain picklable containers: they cross process boundaries to workers and must never
hold torch tensors. The real executor and the simulated executor read and write exactly these.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rackserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the workers have not seen, or one resumed after preemption (its state was
    dropped): everything needed to rebuild the worker's per-request state."""
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]         # non-empty only for a request resumed after preemption
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]    # one block table per KV cache group (a plain list: one group)
    num_computed_tokens: int            # tokens already in the KV cache (prefix hit)
    # Per group, leading blocks that came from the prefix cache while num_computed_tokens starts
    # before them (a bounded replay, core/kv_cache_groups.py): the workers must not write them.
    num_hit_blocks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.block_ids = _per_group(self.block_ids)


@dataclass
class CachedRequestData:
    """A request the workers already hold: only what changed since its last step."""
    req_id: str
    new_block_ids: tuple[list[int], ...]   # appended to its block tables, one per KV cache group
    num_computed_tokens: int

    def __post_init__(self) -> None:
        self.new_block_ids = _per_group(self.new_block_ids)


def _per_group(block_ids: tuple[list[int], ...] | list[int]) -> tuple[list[int], ...]:
    """vLLM's per-group block ids; a plain list is the one group of a model with one kind of cache."""
    return block_ids if isinstance(block_ids, tuple) else (block_ids,)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # req_id -> tokens to compute this step, for every scheduled request, in batch order.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests whose worker state must be dropped: finished, aborted or preempted since the
    # last step. A preempted request comes back later as a NewRequestData.
    finished_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: Any = None   # the KV connector's orders for the workers (kv_transfer/)
    # req_id -> draft tokens (speculative decoding) computed after its last token this step; they are
    # part of its num_scheduled_tokens, and the runner returns those it kept plus one token it sampled.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class LogprobsLists:
    """Logprobs of one sampled token: its own, its rank, and the top-k of the distribution."""
    sampled_logprob: float
    sampled_rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class ModelRunnerOutput:
    # Requests that sampled a token this step (those whose KV caught up with all their
    # tokens), in batch order; a request still in the middle of its prompt samples nothing. With
    # draft tokens, a request's list is the drafts the runner kept and the token it sampled after them.
    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[LogprobsLists] | None]      # per request, one per sampled token (None: not asked)
    # Seconds the DP rank spent computing this step, time inside collectives excluded (its wait
    # for peers); the engine derives each DP rank's idle time from it. None: not measured.
    busy_seconds: float | None = None
    # Tokens routed to each global expert in this step, summed over the MoE layers (one per token
    # and chosen expert; under DP this DP rank's tokens only). None: not an MoE model.
    expert_token_counts: list[int] | None = None
    # Requests this step could not serve (e.g. sampling failed for them alone) -> why. The
    # scheduler ends each with an error; the rest of the batch is unaffected.
    failed: dict[str, str] = field(default_factory=dict)
    kv_connector_output: Any = None     # KVConnectorOutput: transfers that ended (kv_transfer/)
    # With a drafting executor (`"method": "mtp"`): per request of req_ids, the tokens it drafts to
    # follow this step's tokens, proposed at its next decode (core/spec_decode.RunnerDrafts).
    draft_token_ids: list[list[int]] | None = None


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput([], [], [])


@dataclass
class EngineCoreOutput:
    """One request's news from one step."""
    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[LogprobsLists] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None   # where a decoder finds this request's KV

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
