"""SamplingParams: how one request samples and when it stops, named and defaulted as in vLLM.

This file owns validation of sampling options: every bad value raises ValueError with a message
that says what to fix (the server turns it into an HTTP 400). It must never import torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
GREEDY_EPS = 1e-5
# Below this, a repetition penalty divides a logit of a few units past float32's range: every
# seen token's logit becomes +-inf and the row has nothing left to sample from.
MIN_REPETITION_PENALTY = 1e-2
MAX_REPETITION_PENALTY = 1e2
MAX_LOGIT_BIAS = 100.0                  # OpenAI's range for logit_bias values
SEED_RANGE = (-2**63, 2**63 - 1)        # a 64-bit signed seed (OpenAI's `seed` is an int64)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16         # None: up to max_model_len
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None         # None: no logprobs; k: the sampled token's and the top k
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, before penalties
    # KV connector orders for this request (vLLM's kv_transfer_params): {"do_remote_decode": true}
    # keeps its prompt's KV for a decoder; {"do_remote_prefill": true, ...} pulls it from a prefiller.
    kv_transfer_params: dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)
        # NaN passes every range check below (each comparison is False), so non-finite values
        # are refused first, by name.
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                bad(f"{name} must be a finite number, got {value!r}")
        if self.n < 1:
            bad(f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            bad(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            bad(f"top_k must be 0 or -1 (disabled) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            bad(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}] "
                f"(1 is none), got {self.repetition_penalty}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            bad(f"seed must be a 64-bit signed integer, got {self.seed}")
        for token_id, bias in (self.logit_bias or {}).items():
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias) \
                    or abs(bias) > MAX_LOGIT_BIAS:
                bad(f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                    f"got {bias!r} for token {token_id}")
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                bad(f"logit_bias keys must be token ids (non-negative integers), got {token_id!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop strings must be non-empty strings")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            bad(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def child(self, index: int) -> "SamplingParams":
        """The params of the index-th of n samples: n=1, and a distinct seed when seeded."""
        from dataclasses import replace
        # Wrapped around within 64 bits, so that a seed near the top of the range stays valid.
        seed = None if self.seed is None else (self.seed + index - SEED_RANGE[0]) % 2**64 + SEED_RANGE[0]
        return replace(self, n=1, seed=seed)
