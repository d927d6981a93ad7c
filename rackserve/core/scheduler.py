"""Scheduler: decides WHAT runs each step.

One rule, no phases: every step hands each scheduled request some of the tokens it has not computed
yet, out of a token budget (`max_num_batched_tokens`). Running requests go first, in arrival order
(decodes and unfinished prompt chunks alike), then waiting requests are admitted FCFS with their
cached prefix while the budget, `max_num_seqs` and free KV blocks allow. When blocks run out, the
most recently admitted running request is preempted by recompute: its blocks are freed (its full
ones stay in the prefix cache) and it waits again at the front of the queue.

This file never imports torch and never touches KV block internals (KVCacheManager owns those).
"""
from __future__ import annotations

from collections import deque

from rackserve.config import EngineConfig
from rackserve.core.kv_cache_manager import KVCacheManager
from rackserve.core.outputs import (CachedRequestData, EngineCoreOutput, ModelRunnerOutput,
                                    NewRequestData, SchedulerOutput)
from rackserve.core.request import Request, RequestStatus
from rackserve.core.stats import SchedulerStats, sum_expert_token_counts


class Scheduler:
    def __init__(self, config: EngineConfig, num_kv_blocks: int):
        assert config.model.max_model_len is not None, "resolve max_model_len first"
        self.max_model_len = config.model.max_model_len
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        self.block_size = config.cache.block_size
        if num_kv_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_kv_blocks * self.block_size} tokens, fewer than "
                f"max_model_len={self.max_model_len}: raise --kv-cache-memory or lower --max-model-len")
        # The hash namespace never follows the sampling seed (--seed): instances that sample
        # differently must still name equal prefixes alike (KV events, router, KV pool).
        self.kv = KVCacheManager(num_kv_blocks, self.block_size, config.cache.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._in_workers: set[str] = set()        # requests whose state the workers hold
        self._drop_from_workers: set[str] = set()  # to tell the workers in the next step
        self._stats = SchedulerStats()

    # -- requests in and out ------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(f"prompt has {request.num_prompt_tokens} tokens; max_model_len is "
                             f"{self.max_model_len}, which must leave room for at least one output token")
        room = self.max_model_len - request.num_prompt_tokens
        max_tokens = request.sampling_params.max_tokens
        request.max_tokens = room if max_tokens is None else min(max_tokens, room)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus,
                        stop_reason: str | None = None) -> None:
        """End requests from outside (abort, stop string). Unknown or finished ids are ignored."""
        assert status.finished
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            request.stop_reason = stop_reason
            self._release(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            assert n > 0, "a running request always has a token to compute"
            block_ids = self.kv.allocate_slots(request, n)
            while block_ids is None:
                # Running requests behind this one have not been scheduled yet: take the last.
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                block_ids = self.kv.allocate_slots(request, n)
            if block_ids is None:
                break
            assert request.request_id in self._in_workers
            cached_reqs.append(CachedRequestData(request.request_id, block_ids, request.num_computed_tokens))
            num_scheduled[request.request_id] = n
            budget -= n
            i += 1

        # Admitting while preempting would only thrash: whoever was preempted waits first.
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.max_num_seqs):
            request = self.waiting[0]
            hit = self.kv.get_computed_blocks(request)
            n = min(request.num_tokens - hit.num_tokens, budget)
            if self.kv.allocate_slots(request, n, hit) is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = hit.num_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = hit.num_tokens
            self._stats.prefix_cache_queries += request.num_tokens
            self._stats.prefix_cache_hits += hit.num_tokens
            self.running.append(request)
            new_reqs.append(self._new_request_data(request))
            num_scheduled[request.request_id] = n
            budget -= n

        output = SchedulerOutput(new_reqs, cached_reqs, num_scheduled,
                                 total_num_scheduled_tokens=sum(num_scheduled.values()),
                                 finished_req_ids=self._drop_from_workers)
        self._drop_from_workers = set()
        # The KV of scheduled tokens is computed by the time anyone looks again.
        for req_id, n in num_scheduled.items():
            self.requests[req_id].num_computed_tokens += n
        return output

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        stats = self._stats
        stats.expert_token_counts = sum_expert_token_counts([stats.expert_token_counts,
                                                             runner_output.expert_token_counts])
        outputs = []
        for req_id, reason in runner_output.failed.items():
            request = self.requests.get(req_id)
            if request is not None and not request.finished:
                self.finish_requests([req_id], RequestStatus.FINISHED_ERROR, reason)
                outputs.append(EngineCoreOutput(req_id, [], None, "error", reason, request.num_cached_tokens))
        for req_id, token_ids, logprobs in zip(runner_output.req_ids, runner_output.sampled_token_ids,
                                                runner_output.logprobs):
            request = self.requests.get(req_id)
            if request is None or request.finished:
                continue   # finished from outside while the step ran
            new_tokens = []
            for token_id in token_ids:
                request.append_output_token(token_id)
                new_tokens.append(token_id)
                if request.check_stop(self.max_model_len):
                    break
            if request.finished:
                self.running.remove(request)
                self._release(request)
            outputs.append(EngineCoreOutput(
                req_id, new_tokens, None if logprobs is None else [logprobs],
                request.status.finish_reason, request.stop_reason, request.num_cached_tokens))
        return outputs

    def make_stats(self) -> SchedulerStats:
        """Snapshot for stat loggers; the per-step counters restart at zero."""
        stats = self._stats
        stats.num_running_reqs = len(self.running)
        stats.num_waiting_reqs = len(self.waiting)
        stats.kv_cache_usage = self.kv.usage()
        self._stats = SchedulerStats()
        return stats

    # -- internals ----------------------------------------------------------------------------
    def _new_request_data(self, request: Request) -> NewRequestData:
        self._in_workers.add(request.request_id)
        return NewRequestData(request.request_id, request.prompt_token_ids, list(request.output_token_ids),
                              request.sampling_params, self.kv.block_ids(request), request.num_computed_tokens)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        self._forget_in_workers(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._stats.num_preemptions += 1
        self.waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        self.kv.free(request)
        self._forget_in_workers(request)
        del self.requests[request.request_id]

    def _forget_in_workers(self, request: Request) -> None:
        if request.request_id in self._in_workers:
            self._in_workers.remove(request.request_id)
            self._drop_from_workers.add(request.request_id)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        if not self.requests:
            assert self.kv.usage() == 0.0, "idle but blocks are in use"
