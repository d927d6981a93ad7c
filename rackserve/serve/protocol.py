"""The OpenAI wire format: request bodies (validated with pydantic) and response bodies, named
as OpenAI's and vLLM's so clients written for either work here.

This file owns field names, field types and defaults, and the mapping of a request onto
SamplingParams. It must never check sampling values itself (SamplingParams does, and its
ValueError becomes the HTTP 400) and never touch the engine.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from rackserve.engine.tokenizer import PromptTooLongError, Tokenizer
from rackserve.sampling_params import SamplingParams

MAX_COMPLETION_LOGPROBS = 5             # the legacy completions API allows logprobs 0..5
NOT_HONOURED = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                "guided_grammar", "use_beam_search", "min_tokens", "prompt_logprobs")


# Every list in a request stops at its first bad item. Otherwise a body of wrong items gets an
# error per item per union member (a 14 MB prompt of 1.2M id lists: 35 s and 1.5 GB on the event
# loop, niced, before its 400).
FAIL_FAST = Field(fail_fast=True)
Ids = Annotated[list[int], FAIL_FAST]
Strs = Annotated[list[str], FAIL_FAST]


def at_most_max_messages(messages: Any, info: ValidationInfo) -> Any:
    """A list of more messages than the validation context's `max_messages` (the context length)
    is refused before a message model is built, by the rule the router and /tokenize apply too
    (Tokenizer.check_messages_fit): 424k empty messages took 2.2 s of the event loop to build,
    niced, before the count refused them."""
    limit = (info.context or {}).get("max_messages")
    if limit is not None and isinstance(messages, list):
        try:
            Tokenizer.check_messages_fit(len(messages), limit)
        except PromptTooLongError as e:
            raise PydanticCustomError("too_long", str(e)) from None
    return messages


class OpenAIBaseModel(BaseModel):
    # Strict: a JSON API must say "0.5" is not a number instead of guessing. Unknown fields
    # (user, metadata, store...) are ignored as OpenAI's own server does.
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class SamplingRequest(OpenAIBaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions; None means the default."""
    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | Strs | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: Ids | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's: requests with different salts never share prefix-cache blocks (tenant isolation)
    cache_salt: str | None = Field(default=None, min_length=1)
    kv_transfer_params: dict[str, Any] | None = None   # vLLM's P/D orders (kv_transfer/)
    # vLLM's: pin the request to this DP rank of the instance (the router's choice); None: the
    # instance's own placement.
    data_parallel_rank: int | None = None
    # Asked-for behaviour this server does not have (structured outputs, beam search, vLLM's
    # min_tokens and prompt_logprobs): declared only to be refused by name, since ignoring them
    # as unknown fields would hand a client that asked for JSON unconstrained text.
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    use_beam_search: Any = None
    min_tokens: Any = None
    prompt_logprobs: Any = None

    def unsupported(self) -> str | None:
        """The name of a field set to something this server cannot honour, if any."""
        if self.stream_options is not None and not self.stream:
            return "stream_options"
        for name in NOT_HONOURED:
            value = getattr(self, name)
            if value not in (None, False, 0) and not (name == "response_format" and value == {"type": "text"}):
                return name
        return None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError (with SamplingParams' message) for values out of range."""
        def given(value: Any, default: Any) -> Any:
            return default if value is None else value
        return SamplingParams(
            n=given(self.n, 1), temperature=given(self.temperature, 1.0), top_p=given(self.top_p, 1.0),
            top_k=given(self.top_k, 0), min_p=given(self.min_p, 0.0), seed=self.seed,
            presence_penalty=given(self.presence_penalty, 0.0),
            frequency_penalty=given(self.frequency_penalty, 0.0),
            repetition_penalty=given(self.repetition_penalty, 1.0), max_tokens=max_tokens,
            stop=given(self.stop, []), stop_token_ids=given(self.stop_token_ids, []),
            ignore_eos=self.ignore_eos, logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self._logit_bias(),
            kv_transfer_params=self.kv_transfer_params)

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's logit_bias has token ids as JSON object keys (strings)."""
        if not self.logit_bias:
            return None
        try:
            return {int(key): value for key, value in self.logit_bias.items()}
        except ValueError:
            raise ValueError("logit_bias keys must be token ids written as integers, e.g. "
                             '{"50256": -100}') from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


Prompt = str | Ids | Strs | Annotated[list[Ids], FAIL_FAST]


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    max_tokens: int | None = 16         # the legacy API's default
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    return_token_ids: bool = False      # vLLM's: choices carry prompt_token_ids and token_ids

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo"
        if self.suffix:
            return "suffix"
        if self.best_of is not None and self.best_of != (self.n or 1):
            return "best_of"
        return super().unsupported()

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one string or token list, or a batch of them."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and isinstance(self.prompt[0], (str, list)):
            return list(self.prompt)
        return [self.prompt]


class TextContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextContentPart], FAIL_FAST] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], FAIL_FAST]
    max_tokens: int | None = None       # None: up to the context length
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    # With no tools served, "none" and "auto" both mean a plain answer; "required", a named function
    # or anything else asks for a call this server never makes: refused by name, not ignored.
    tool_choice: Any = None
    functions: Any = None           # OpenAI's deprecated tools and tool_choice, likewise
    function_call: Any = None
    # rackserve's extension: the messages already rendered and tokenized (the router sends them,
    # having tokenized to route); the chat template is then skipped.
    prompt_token_ids: Ids | None = Field(default=None, min_length=1)
    # vLLM's chat template controls, declared only to be refused by name when they ask for other
    # than the default (this server renders the template one way: a new assistant turn), since
    # ignoring them would answer a different prompt than the one asked for.
    echo: Any = None
    continue_final_message: Any = None
    add_generation_prompt: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None

    _bounded = field_validator("messages", mode="before")(at_most_max_messages)

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools"
        if self.functions:
            return "functions"
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none", "auto"):
                return name
        for name in ("echo", "continue_final_message", "chat_template", "chat_template_kwargs"):
            if getattr(self, name) not in (None, False, {}):
                return name
        if self.add_generation_prompt not in (None, True):
            return "add_generation_prompt"
        return super().unsupported()

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


# ---- responses ----------------------------------------------------------------------------


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None   # with return_token_ids (streamed: first chunk only)
    token_ids: list[int] | None = None


class CompletionResponse(OpenAIBaseModel):
    """Also each streamed chunk: OpenAI streams completions as "text_completion" objects."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None   # a prefiller's answer: where its KV waits


class ChatTopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogProbs(OpenAIBaseModel):
    content: list[ChatLogprobToken] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None   # a prefiller's answer: where its KV waits


class DeltaMessage(OpenAIBaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "rackserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo
