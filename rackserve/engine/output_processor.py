"""OutputProcessor: turns EngineCoreOutputs (token ids) into RequestOutput deltas (text, logprobs),
finds stop strings, groups the n samples of a request, and measures per-request latencies.

It owns per-request text state. It never schedules: a stop string it finds is reported back so the
caller ends that request in the engine core.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from rackserve.core.outputs import EngineCoreOutput, LogprobsLists
from rackserve.engine.detokenizer import IncrementalDetokenizer
from rackserve.engine.stats import FinishedRequestStats, IterationStats
from rackserve.engine.tokenizer import Tokenizer
from rackserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from rackserve.sampling_params import SamplingParams


@dataclass
class _SampleState:
    """One of the n samples of a request; it runs in the engine core as its own request."""
    parent: "_ParentState"
    index: int
    detokenizer: IncrementalDetokenizer | None     # None without a tokenizer: token ids only
    num_tokens: int = 0
    last_token_time: float = 0.0


@dataclass
class _ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    engine_ids: list[str]               # the engine core's id of each sample
    num_unfinished: int
    num_cached_tokens: int = 0


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    stops: dict[str, str]           # engine request id -> stop string that ended it
    iteration_stats: IterationStats
    errors: dict[str, str]          # engine request id -> why processing its output failed


def sample_request_id(request_id: str, index: int, n: int) -> str:
    """The engine core's id for the index-th sample of a request."""
    return request_id if n == 1 else f"{index}_{request_id}"


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, clock: Callable[[], float] = time.monotonic):
        self.tokenizer = tokenizer
        self.clock = clock              # the engine's clock: real, or the simulator's virtual one
        self.parents: dict[str, _ParentState] = {}
        self.samples: dict[str, _SampleState] = {}
        self._aborted: list[FinishedRequestStats] = []   # aborts since the last stats report

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float) -> list[str]:
        """Track a request; returns the engine ids of its n samples."""
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already running")
        ids = [sample_request_id(request_id, i, params.n) for i in range(params.n)]
        parent = _ParentState(request_id, prompt, prompt_token_ids, RequestMetrics(arrival_time), ids, params.n)
        self.parents[request_id] = parent
        for index, engine_id in enumerate(ids):
            detokenizer = None if self.tokenizer is None else \
                IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
            self.samples[engine_id] = _SampleState(parent, index, detokenizer)
        return ids

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; returns the engine ids of its samples, to abort in the engine core.
        Its unfinished samples are reported as finished with "abort" in the next stats."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return []
        now = self.clock()
        for engine_id in parent.engine_ids:
            sample = self.samples.pop(engine_id, None)
            if sample is not None:
                self._aborted.append(FinishedRequestStats(
                    "abort", now - parent.metrics.arrival_time, len(parent.prompt_token_ids), sample.num_tokens))
        return parent.engine_ids

    def record_unstarted_abort(self, num_samples: int) -> None:
        """A request aborted before it reached the engine (its client left while it was being
        tokenized): reported with the other aborts, so that finished requests add up to sent ones."""
        self._aborted += [FinishedRequestStats("abort", 0.0, 0, 0)] * num_samples

    def take_aborted(self) -> list[FinishedRequestStats]:
        """Aborts not yet reported (process() reports them with its step's stats)."""
        aborted, self._aborted = self._aborted, []
        return aborted

    def process(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        now = self.clock()
        stats = IterationStats(finished_requests=self._aborted)
        self._aborted = []
        stops: dict[str, str] = {}
        errors: dict[str, str] = {}
        by_parent: dict[str, RequestOutput] = {}
        for out in outputs:
            sample = self.samples.get(out.req_id)
            if sample is None:
                continue   # aborted by the caller while the step ran
            try:
                text, finish_reason, stop_reason = self._text(sample, out, now, stats, stops)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                errors[out.req_id] = f"processing the output failed: {type(e).__name__}: {e}"
                text, finish_reason, stop_reason = "", "error", errors[out.req_id]
            parent = sample.parent
            if finish_reason is not None:
                self._finish(sample, out.req_id, finish_reason, now, stats)
            parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
            completion = CompletionOutput(
                sample.index, text, list(out.new_token_ids),
                cumulative_logprob=(None if out.new_logprobs is None
                                    else sum(e.sampled_logprob for e in out.new_logprobs)),
                logprobs=None if out.req_id in errors else self._logprobs(out.new_logprobs, out.new_token_ids),
                finish_reason=finish_reason, stop_reason=stop_reason)
            ro = by_parent.get(parent.request_id)
            if ro is None:
                ro = by_parent[parent.request_id] = RequestOutput(
                    parent.request_id, parent.prompt, parent.prompt_token_ids, [], False,
                    parent.num_cached_tokens, parent.metrics)
            ro.outputs.append(completion)
            ro.finished = parent.num_unfinished == 0
            ro.num_cached_tokens = parent.num_cached_tokens
            ro.kv_transfer_params = out.kv_transfer_params or ro.kv_transfer_params
            if ro.finished:
                parent.metrics.finished_time = now
        return ProcessedOutputs(list(by_parent.values()), stops, stats, errors)

    def _text(self, sample: _SampleState, out: EngineCoreOutput, now: float, stats: IterationStats,
              stops: dict[str, str]) -> tuple[str, str | None, int | str | None]:
        """The sample's new text and how it finished (a stop string found here goes in `stops`)."""
        self._record_timing(sample, out, now, stats)
        detokenizer = sample.detokenizer
        if detokenizer is None:     # skip_tokenizer_init: token ids only
            return "", out.finish_reason, out.stop_reason
        text = detokenizer.update(out.new_token_ids, out.finished)
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        if detokenizer.stop_string is not None and not out.finished:
            finish_reason, stop_reason = "stop", detokenizer.stop_string
            stops[out.req_id] = stop_reason
            text += detokenizer.update([], True)   # release what was held back
        return text, finish_reason, stop_reason

    def _finish(self, sample: _SampleState, engine_id: str, finish_reason: str, now: float,
                stats: IterationStats) -> None:
        parent = sample.parent
        parent.num_unfinished -= 1
        del self.samples[engine_id]
        if parent.num_unfinished == 0:
            del self.parents[parent.request_id]
        stats.finished_requests.append(FinishedRequestStats(
            finish_reason, now - parent.metrics.arrival_time, len(parent.prompt_token_ids), sample.num_tokens))

    @staticmethod
    def _record_timing(sample: _SampleState, out: EngineCoreOutput, now: float, stats: IterationStats) -> None:
        if not out.new_token_ids:
            return
        metrics = sample.parent.metrics
        if sample.num_tokens > 0:
            stats.inter_token_latencies.append(now - sample.last_token_time)
        elif metrics.first_token_time is None:   # the request's first token, of any sample
            metrics.first_token_time = now
            stats.time_to_first_tokens.append(now - metrics.arrival_time)
            stats.num_prompt_tokens += len(sample.parent.prompt_token_ids)
        sample.num_tokens += len(out.new_token_ids)
        sample.last_token_time = now
        stats.num_generation_tokens += len(out.new_token_ids)

    def _logprobs(self, lists: list[LogprobsLists] | None, token_ids: list[int]) -> list[dict[int, Logprob]] | None:
        if lists is None:
            return None
        out = []
        for entry, token_id in zip(lists, token_ids):
            d = {token_id: Logprob(entry.sampled_logprob, entry.sampled_rank, self._token_text(token_id))}
            for rank, (tid, lp) in enumerate(zip(entry.top_token_ids, entry.top_logprobs), start=1):
                d.setdefault(tid, Logprob(lp, rank, self._token_text(tid)))
            out.append(d)
        return out

    def _token_text(self, token_id: int) -> str | None:
        return self.tokenizer.token_text(token_id) if self.tokenizer else None
