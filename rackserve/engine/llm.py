"""LLM: the offline API, shaped as vLLM's: `LLM(model=..., **engine options).generate(prompts,
params)` returns one finished RequestOutput per prompt, in order; `.chat(messages, params)` applies
the model's chat template first.

It owns batching a call's prompts through one LLMEngine until all finish; it never runs threads.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from rackserve.config import DEFAULT_MODEL, EngineArgs
from rackserve.engine.llm_engine import LLMEngine, PromptType
from rackserve.engine.tokenizer import Tokenizer
from rackserve.outputs import RequestOutput
from rackserve.sampling_params import SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_options: Any):
        """engine_options are named as the CLI flags: dtype="float32", max_num_seqs=8, ..."""
        self.engine = LLMEngine(EngineArgs.from_kwargs(model=model, **engine_options))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer | None:
        """None when the engine runs with skip_tokenizer_init."""
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = self._params_per_prompt(sampling_params, len(prompts))
        # Validate everything before queueing anything, so a bad prompt leaves the engine clean.
        prepared = [self.engine.prepare(str(next(self._ids)), p, sp) for p, sp in zip(prompts, params)]
        for req in prepared:
            self.engine.add_prepared(req)
        results: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                if delta.request_id in results:
                    results[delta.request_id].add(delta)
                else:
                    results[delta.request_id] = delta
        return [results[req.request_id] for req in prepared]

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs the tokenizer's chat template, which skip_tokenizer_init "
                             "leaves out; pass token ids to generate() instead")
        prompts = []
        for conversation in conversations:
            ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
            prompts.append({"prompt": tokenizer.decode(ids, skip_special_tokens=False), "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    @staticmethod
    def _params_per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; pass one, or one per prompt")
        return list(params)
