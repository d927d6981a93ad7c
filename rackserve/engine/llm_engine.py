"""LLMEngine: one serving instance, stepped synchronously: tokenizer + EngineCore + OutputProcessor.

It owns the request front door: turning prompts into token ids, rejecting requests that can never
run (with a message that says what to fix), fanning out n samples, and reporting stats after each
step. It never runs threads (AsyncEngine drives it from one) and never speaks HTTP.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Union

from rackserve.config import EngineArgs, EngineConfig
from rackserve.core.request import Request, RequestStatus
from rackserve.engine.core import EngineCore
from rackserve.executor.base import Executor
from rackserve.engine.output_processor import OutputProcessor
from rackserve.engine.stats import IterationStats, StatLogger
from rackserve.engine.tokenizer import load_tokenizer
from rackserve.outputs import RequestOutput
from rackserve.sampling_params import SamplingParams

# A prompt: text, or {"prompt": text} / {"prompt_token_ids": [...]} as vLLM accepts them.
PromptType = Union[str, dict]


class EngineDeadError(RuntimeError):
    """The engine failed (a step raised, e.g. a worker died) or was shut down: it takes no more work."""


class RequestFailedError(RuntimeError):
    """One request failed on its own (e.g. its sampling raised); the engine and others go on."""


class EngineOverloadedError(RuntimeError):
    """The engine's waiting queue is full; the request was not taken (retry later)."""


@dataclass
class PreparedRequest:
    """A validated request, ready to enter the engine."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    cache_salt: str | None = None
    data_parallel_rank: int | None = None   # pinned by the caller (a router); None: placement picks


class LLMEngine:
    def __init__(self, config: EngineConfig | EngineArgs, stat_loggers: list[StatLogger] | tuple = (),
                 executor: Executor | None = None, clock: Callable[[], float] = time.monotonic):
        """`executor`: any Executor (e.g. create_executor(config, name) from the registry); default:
        the registry's choice for the config. `clock`: the source of every timestamp (arrivals,
        token times), real by default, virtual under a simulator."""
        if isinstance(config, EngineArgs):
            config = config.create_engine_config()
        # skip_tokenizer_init: token ids in and out, no text (and so no EOS the engine could know).
        self.tokenizer = None if config.model.skip_tokenizer_init else load_tokenizer(config.model.tokenizer)
        self.eos_token_ids = self.tokenizer.eos_token_ids if self.tokenizer else frozenset()
        self.core = EngineCore(config, executor)
        self.config = self.core.config
        self.clock = clock
        self.processor = OutputProcessor(self.tokenizer, clock)
        self.stat_loggers = list(stat_loggers)
        self.failure: BaseException | None = None   # why the engine is dead, once a step raised

    def prepare(self, request_id: str, prompt: PromptType | list[int], params: SamplingParams,
                cache_salt: str | None = None, data_parallel_rank: int | None = None) -> PreparedRequest:
        """Tokenize and validate; raises ValueError for a request that can never run."""
        text, token_ids = self._tokenize(prompt)
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need the tokenizer, which skip_tokenizer_init leaves out; "
                             "use stop_token_ids")
        max_len = self.config.model.max_model_len
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) >= max_len:
            raise ValueError(f"This model's maximum context length is {max_len} tokens. However, your "
                             f"prompt has {len(token_ids)} tokens, which leaves no room for output. "
                             "Please reduce the length of the prompt.")
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > max_len:
            raise ValueError(f"This model's maximum context length is {max_len} tokens. However, you "
                             f"requested {len(token_ids) + params.max_tokens} tokens ({len(token_ids)} in "
                             f"the prompt, {params.max_tokens} in the completion). Please reduce the "
                             "length of the prompt or max_tokens.")
        vocab = self.core.executor.vocab_size   # after the length: a prompt of millions of ids is not scanned
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if params.logit_bias and any(not 0 <= t < vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab})")
        dp_size = self.config.parallel.data_parallel_size
        if data_parallel_rank is not None and not 0 <= data_parallel_rank < dp_size:
            raise ValueError(f"data_parallel_rank={data_parallel_rank}; this instance has DP ranks 0..{dp_size - 1}")
        return PreparedRequest(request_id, text, token_ids, params, self.clock(), cache_salt, data_parallel_rank)

    def add_prepared(self, req: PreparedRequest) -> None:
        self.check_alive()
        engine_ids = self.processor.add_request(req.request_id, req.prompt, req.prompt_token_ids,
                                                req.params, req.arrival_time)
        self.core.add_requests([
            Request(engine_id, req.prompt_token_ids, req.params if req.params.n == 1 else req.params.child(index),
                    eos_token_ids=self.eos_token_ids, arrival_time=req.arrival_time,
                    cache_salt=req.cache_salt)
            for index, engine_id in enumerate(engine_ids)], req.data_parallel_rank)

    def add_request(self, request_id: str, prompt: PromptType | list[int], params: SamplingParams) -> None:
        self.add_prepared(self.prepare(request_id, prompt, params))

    def abort_request(self, request_id: str) -> None:
        self.core.abort_requests(self.processor.abort(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def check_alive(self) -> None:
        if self.failure is not None:
            raise EngineDeadError(f"the engine failed earlier and takes no more requests: {self.failure}")

    def step(self) -> list[RequestOutput]:
        """One engine step; returns a delta for every request that produced tokens. If the step
        raises, the engine is dead: its requests' state is gone with the workers."""
        self.check_alive()
        try:
            outputs, scheduler_stats = self.core.step()
        except BaseException as e:
            self.failure = e
            raise
        processed = self.processor.process(outputs)
        if processed.stops:
            self.core.stop_requests(processed.stops)
        if processed.errors:
            self.core.stop_requests(processed.errors, RequestStatus.FINISHED_ERROR)
        for logger in self.stat_loggers:
            logger.record(scheduler_stats, processed.iteration_stats)
        return processed.request_outputs

    def record_idle_stats(self) -> None:
        """Report the scheduler's state when no step will run (after aborts emptied it)."""
        stats = self.core.make_stats()
        iteration = IterationStats(finished_requests=self.processor.take_aborted())
        for logger in self.stat_loggers:
            logger.record(stats, iteration)

    def shutdown(self) -> None:
        self.core.shutdown()

    def _tokenize(self, prompt: PromptType | list[int]) -> tuple[str | None, list[int]]:
        text_only = isinstance(prompt, str) or isinstance(prompt, dict) and "prompt_token_ids" not in prompt
        if self.tokenizer is None and text_only:
            raise ValueError("this engine runs with skip_tokenizer_init: prompts must be token ids "
                             "(a list of ints or {'prompt_token_ids': [...]}), not text")
        text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
        if isinstance(text, str) and self.tokenizer is not None:   # refuse a text too long to fit before tokenizing all of it
            self.tokenizer.check_fits(len(text), self.config.model.max_model_len)
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError("a prompt is a string, a list of token ids, or a dict with 'prompt' or "
                         "'prompt_token_ids'")
