"""Scheduler: decides WHAT runs each step.

One rule, no phases: every step hands each scheduled request some of the tokens it has not computed
yet, out of a token budget (`max_num_batched_tokens`). Running requests go first, in arrival order
(decodes and unfinished prompt chunks alike), then waiting requests are admitted FCFS with their
cached prefix while the budget, `max_num_seqs` and free KV blocks allow. When blocks run out, the
most recently admitted running request is preempted by recompute: its blocks are freed (its full
ones stay in the prefix cache) and it waits again at the front of the queue.

With --speculative-config, a decoding request computes its last token and the draft tokens the
proposer (core/spec_decode.py: prompt lookup, or the drafts the executor sent with the request's last
step) gives it, as far as the budget leaves room; the drafts the runner
rejects are taken back from its computed tokens when the step's output arrives (their KV slots are
written over by the next step), and no draft ever enters the prefix cache (blocks are cached only
as far as the request's own tokens).

With a KV connector (kv_transfer/), a request whose prompt KV comes from elsewhere is admitted into
WAITING_FOR_REMOTE_KVS: it holds blocks that no other request can hit until the workers report the
KV landed, then it waits again at the front of the queue (or recomputes, if the load failed). A
finished request the connector wants to keep for a peer leaves its blocks held until the workers
report the peer is done with them (or its lease ran out).

This file never imports torch and never touches KV block internals (KVCacheManager owns those).
"""
from __future__ import annotations

from collections import deque

from rackserve.config import EngineConfig
from rackserve.core.hybrid_kv_cache_manager import HybridKVCacheManager
from rackserve.core.kv_cache_groups import KVCacheConfig
from rackserve.core.kv_cache_manager import NO_HIT, KVCacheManager
from rackserve.core.outputs import (CachedRequestData, EngineCoreOutput, ModelRunnerOutput,
                                    NewRequestData, SchedulerOutput)
from rackserve.core.request import Request, RequestStatus
from rackserve.core.stats import SchedulerStats, sum_expert_token_counts
from rackserve.core.remote_kv import RemoteKV
from rackserve.core.spec_decode import NgramProposer, RunnerDrafts
from rackserve.kv_transfer.base import create_kv_connector_scheduler


class Scheduler:
    def __init__(self, config: EngineConfig, num_kv_blocks: int, kv_cache_config: KVCacheConfig | None = None,
                 dp_rank: int = 0):
        """`kv_cache_config`: the cache groups of a model with several kinds of cache (None: one
        group of `num_kv_blocks` blocks). `dp_rank`: the DP rank whose KV cache this plans for
        (its KV connector serves and names that rank)."""
        assert config.model.max_model_len is not None, "resolve max_model_len first"
        self.max_model_len = config.model.max_model_len
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        self.long_prefill_token_threshold = config.scheduler.long_prefill_token_threshold
        self.max_waiting_tokens = config.scheduler.max_waiting_tokens
        self._prompts_waited = 0   # steps in a row that prompt work waited for the decodes
        self.block_size = config.cache.block_size
        if kv_cache_config is not None:   # the scarcest non-sliding group bounds a request
            num_kv_blocks = min(g.num_blocks * g.block_size // self.block_size for g in kv_cache_config.groups[1:])
        if num_kv_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_kv_blocks * self.block_size} tokens, fewer than "
                f"max_model_len={self.max_model_len}: raise --kv-cache-memory or lower --max-model-len")
        # The hash namespace never follows the sampling seed (--seed): instances that sample
        # differently must still name equal prefixes alike (KV events, router, KV pool).
        kv_events = config.kv_events is not None and config.kv_events.enable_kv_cache_events
        self.kv = KVCacheManager(num_kv_blocks, self.block_size, config.cache.enable_prefix_caching,
                                 enable_kv_cache_events=kv_events) if kv_cache_config is None else \
            HybridKVCacheManager(kv_cache_config, self.block_size, config.cache.enable_prefix_caching,
                                 enable_kv_cache_events=kv_events)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._in_workers: set[str] = set()        # requests whose state the workers hold
        self._drop_from_workers: set[str] = set()  # to tell the workers in the next step
        self._stats = SchedulerStats()
        self._failed: list[EngineCoreOutput] = []   # requests ended with an error, to report
        self.connector = create_kv_connector_scheduler(config, dp_rank, kv_cache_config)
        self.remote = None if self.connector is None else \
            RemoteKV(self.connector, self.kv, config.kv_transfer.kv_load_failure_policy)
        spec = config.speculative
        self.proposer = None if spec is None else \
            RunnerDrafts(spec) if spec.method == "mtp" else NgramProposer(spec)
        self.spec_max_running = spec and spec.disable_by_batch_size
        if self.proposer is not None and kv_cache_config is not None:
            raise ValueError("--speculative-config with a model of several kinds of KV cache (a sliding window, "
                             "compressed entries: DeepSeek-V4) is not supported: its drafts' compressed KV "
                             "could not be taken back")

    # -- requests in and out ------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(f"prompt has {request.num_prompt_tokens} tokens; max_model_len is "
                             f"{self.max_model_len}, which must leave room for at least one output token")
        if self.connector:
            self.connector.validate_request(request)
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
            loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif not loading:
                self.waiting.remove(request)
                if self.remote is not None:
                    self.remote.landed.discard(req_id)
            request.status = status
            request.stop_reason = stop_reason
            if loading:   # the workers still write into its blocks: free them once the load ends
                del self.requests[req_id]
            else:
                self._release(request, may_hold=False)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or (self.remote is not None and self.remote.has_pending_work())

    def has_kv_transfers(self) -> bool:
        """Blocks held for a peer: the workers must keep stepping to hear when they may go."""
        return self.remote is not None and self.remote.has_transfers()

    # -- the step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        spec_tokens: dict[str, list[int]] = {}
        preempted = False

        # Decode first: a prefill chunk ahead of decodes in the queue leaves them their tokens,
        # so that a long prompt never stalls the streams already generating.
        decodes_left = sum(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
        prefill_left = self._prefill_allowance(decodes_left)
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            remaining = request.num_tokens - request.num_computed_tokens
            assert remaining > 0, "a running request always has a token to compute"
            decodes_left -= remaining == 1
            n = remaining if remaining == 1 else \
                self._prefill_chunk(remaining, min(budget - decodes_left, prefill_left))
            if n == 0:
                i += 1
                continue
            drafts = self._drafts(request, budget - decodes_left - 1) if remaining == 1 else []
            # Drafts take free blocks only: no one is preempted for a guess.
            block_ids = self.kv.allocate_slots(request, n + len(drafts)) if drafts else None
            if block_ids is None:
                drafts = []
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
            if drafts:
                spec_tokens[request.request_id] = drafts
                n += len(drafts)
            num_scheduled[request.request_id] = n
            budget -= n
            prefill_left -= n if remaining > 1 else 0
            i += 1

        # Admitting while preempting would only thrash: whoever was preempted waits first.
        # A decoder's request (P/D) never waits for the prompt allowance: starting its KV load
        # computes nothing, and once its KV landed it computes one token, as a decode does. It
        # passes the prompts that wait (`held`, back at the front of the queue after the loop).
        held: list[Request] = []
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.max_num_seqs):
            request = self.waiting[0]
            landed = self.remote is not None and request.request_id in self.remote.landed
            if prefill_left <= 0 and not (landed or self._pulls_its_prompt(request)):
                if self.remote is None:
                    break
                held.append(self.waiting.popleft())
                continue
            try:
                hit = NO_HIT if landed else self.kv.get_computed_blocks(request)
                num_external = 0 if landed or not self.connector else \
                    self.connector.get_num_new_matched_tokens(request, hit.num_tokens)
            except Exception as e:  # noqa: BLE001 - its tokens or salt cannot be looked up: it alone fails
                self._fail(request.request_id, f"scheduling failed: {type(e).__name__}: {e}")
                continue
            if num_external:   # its KV arrives through the connector: it waits for it aside
                if not self.remote.start_load(request, hit, num_external):
                    break
                self.waiting.popleft()
                self._count_lookup(request, hit.num_tokens, external_queries=request.num_tokens - hit.num_tokens)
                continue
            start = request.num_computed_tokens if landed else hit.num_tokens
            remaining = request.num_tokens - start
            n = 1 if remaining == 1 else self._prefill_chunk(remaining, min(budget, prefill_left))
            if n == 0 or self.kv.allocate_slots(request, n, hit) is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = start
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = hit.num_tokens
            if landed:   # counted when its load started
                self.remote.landed.discard(request.request_id)
            else:
                self._count_lookup(request, hit.num_tokens)
            self.running.append(request)
            new_reqs.append(self._new_request_data(request))
            num_scheduled[request.request_id] = n
            budget -= n
            prefill_left -= n if remaining > 1 else 0
        self.waiting.extendleft(reversed(held))

        # The KV of scheduled tokens is computed by the time anyone looks again.
        for req_id, n in num_scheduled.items():
            self.requests[req_id].num_computed_tokens += n
            if self.connector:   # told before it builds this step's orders: a store rides this step
                request = self.requests[req_id]
                self.connector.request_scheduled(request, self.remote.scheduled_block_ids(request))
        output = SchedulerOutput(new_reqs, cached_reqs, num_scheduled,
                                 total_num_scheduled_tokens=sum(num_scheduled.values()),
                                 finished_req_ids=self._drop_from_workers,
                                 kv_connector_metadata=self.connector.build_connector_meta() if self.connector
                                 else None, scheduled_spec_decode_tokens=spec_tokens)
        self._drop_from_workers = set()
        return output

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        stats = self._stats
        stats.expert_token_counts = sum_expert_token_counts([stats.expert_token_counts,
                                                             runner_output.expert_token_counts])
        outputs = []
        if self.remote is not None and runner_output.kv_connector_output is not None:
            outputs = self._update_from_transfers(runner_output.kv_connector_output)
        outputs += self._failed
        self._failed = []
        for req_id, reason in runner_output.failed.items():
            self._fail(req_id, reason)
        outputs += self._failed
        self._failed = []
        runner_drafts = runner_output.draft_token_ids or [None] * len(runner_output.req_ids)
        for req_id, token_ids, logprobs, next_drafts in zip(runner_output.req_ids, runner_output.sampled_token_ids,
                                                             runner_output.logprobs, runner_drafts):
            request = self.requests.get(req_id)
            if request is None or request.finished:
                continue   # finished from outside while the step ran
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts:   # the runner kept len(token_ids) - 1 of them; the rest's KV is not the request's
                request.num_computed_tokens -= len(drafts) - (len(token_ids) - 1)
                stats.num_drafts += 1
                stats.num_draft_tokens += len(drafts)
                stats.num_accepted_tokens += len(token_ids) - 1
            new_tokens = []
            for token_id in token_ids:
                request.append_output_token(token_id)
                new_tokens.append(token_id)
                if request.check_stop(self.max_model_len):
                    break
            if drafts:   # kept drafts past a stop are not the request's: neither is their KV
                request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
            kv_transfer_params = None
            if request.finished:
                self.running.remove(request)
                kv_transfer_params = self._release(request)
            elif next_drafts and isinstance(self.proposer, RunnerDrafts):
                self.proposer.take(req_id, request.num_tokens, next_drafts)
            outputs.append(EngineCoreOutput(
                req_id, new_tokens, None if logprobs is None else logprobs[:len(new_tokens)],
                request.status.finish_reason, request.stop_reason, request.num_cached_tokens,
                kv_transfer_params))
        return outputs

    def _drafts(self, request: Request, room: int) -> list[int]:
        """The proposer's draft tokens for a decoding request, at most `room` (what the step's budget
        leaves once the decodes behind it have their token), and never more than the request may
        still output or max_model_len holds beyond its next token. Requests with penalties get none
        (each draft's penalties would depend on the drafts before it), nor any while
        disable_by_batch_size requests or more are running."""
        if self.proposer is None or request.sampling_params.has_penalties \
                or (self.spec_max_running and len(self.running) >= self.spec_max_running):
            return []
        room = min(room, request.max_tokens - request.num_output_tokens - 1,
                   self.max_model_len - request.num_tokens - 1)
        return self.proposer.propose(request.request_id, request.all_token_ids, room) if room > 0 else []

    def _prefill_allowance(self, num_decodes: int) -> int:
        """Prompt tokens this step may compute, all requests together. With --max-waiting-tokens N
        (TGI's flag), prompt work (admissions and unfinished prompts) waits while requests decode, up
        to N steps in a row: no new decode joins meanwhile, so the running ones finish in steps of
        their own, and the prompts that waited are then computed together, mostly beside no decode.
        A decode's interval then seldom holds a prompt chunk (a CPU computes a prompt token in about
        a quarter of a batch-1 decode step); the prompts' first tokens come later."""
        if not (self.max_waiting_tokens and num_decodes) or self._prompts_waited >= self.max_waiting_tokens \
                or not (self.waiting or any(r.num_tokens - r.num_computed_tokens > 1 for r in self.running)):
            self._prompts_waited = 0
            return self.max_num_batched_tokens
        self._prompts_waited += 1
        return 0

    def _pulls_its_prompt(self, request: Request) -> bool:
        """A decoder's request whose prompt KV a prefiller computed (kv_transfer_params)"""
        params = request.kv_transfer_params
        return self.connector is not None and bool(params) and bool(params.get("do_remote_prefill"))

    def _prefill_chunk(self, remaining: int, budget: int) -> int:
        """Prompt tokens one request computes this step: at most --long-prefill-token-threshold
        (vLLM's flag; 0: no cap), so that a long prompt takes short steps beside the decodes."""
        cap = self.long_prefill_token_threshold or remaining
        return max(0, min(remaining, budget, cap))

    def make_stats(self) -> SchedulerStats:
        """Snapshot for stat loggers; the per-step counters restart at zero."""
        stats = self._stats
        stats.num_running_reqs = len(self.running)
        stats.num_waiting_reqs = len(self.waiting)
        stats.kv_cache_usage = self.kv.usage()
        stats.kv_events = self.kv.take_events()
        self._stats = SchedulerStats()
        return stats

    # -- internals ----------------------------------------------------------------------------
    def _new_request_data(self, request: Request) -> NewRequestData:
        self._in_workers.add(request.request_id)
        hit_blocks = self.kv.hit_blocks(request) if isinstance(self.kv, HybridKVCacheManager) else ()
        return NewRequestData(request.request_id, request.prompt_token_ids, list(request.output_token_ids),
                              request.sampling_params, self.kv.block_ids(request), request.num_computed_tokens,
                              hit_blocks)

    def _fail(self, req_id: str, reason: str) -> None:
        """End one request with an error of its own (the batch and the engine go on); its output
        is reported by the next update_from_output."""
        request = self.requests.get(req_id)
        if request is not None and not request.finished:
            self.finish_requests([req_id], RequestStatus.FINISHED_ERROR, reason)
            self._failed.append(EngineCoreOutput(req_id, [], None, "error", reason, max(request.num_cached_tokens, 0)))

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        self._forget_in_workers(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._stats.num_preemptions += 1
        self.waiting.appendleft(request)

    def _release(self, request: Request, may_hold: bool = True) -> dict | None:
        """Free a finished request's blocks (or, `may_hold`, let the connector hold them for a
        peer); returns the connector's kv_transfer_params for the caller."""
        params = None
        if self.proposer is not None:
            self.proposer.forget(request.request_id)
        if self.remote is not None and may_hold:
            params = self.remote.finish(request)
        else:
            self.kv.free(request)
        self._forget_in_workers(request)
        del self.requests[request.request_id]
        return params

    def _count_lookup(self, request: Request, hit_tokens: int, external_queries: int = 0) -> None:
        self._stats.prefix_cache_queries += request.num_tokens
        self._stats.prefix_cache_hits += hit_tokens
        self._stats.external_prefix_cache_queries += external_queries

    def _update_from_transfers(self, out) -> list[EngineCoreOutput]:
        """Requeue requests whose KV landed (or must be recomputed); end those whose load failed."""
        results = self.remote.update(out)
        self._stats.kv_transfer.add(out.stats)
        self._stats.external_prefix_cache_hits += results.landed_tokens
        self.waiting.extendleft(reversed(results.requeue))
        for request in results.failed:
            del self.requests[request.request_id]
        return [EngineCoreOutput(r.request_id, [], None, "error", r.stop_reason, 0) for r in results.failed]

    def _forget_in_workers(self, request: Request) -> None:
        if request.request_id in self._in_workers:
            self._in_workers.remove(request.request_id)
            self._drop_from_workers.add(request.request_id)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        if not self.requests and not self.has_kv_transfers():
            assert self.kv.usage() == 0.0, "idle but blocks are in use"
