"""Speculative decoding's proposers: n-gram prompt lookup (vLLM's `"method": "ngram"`), and the
executor's own drafts (`"method": "mtp"`, RunnerDrafts below).

Each step, a request that decodes is given up to k draft tokens: the tokens that followed the latest
earlier occurrence of its last n tokens, for the longest n in [prompt_lookup_min, prompt_lookup_max]
that occurs before. The model runner computes the request's last token and the drafts in one
forward pass and keeps the drafts up to the first one it would not have sampled itself, plus the
token it sampled there (executor/model_runner.py), so outputs are the model's own: a draft only
saves the steps it was right about. A draft is a guess that costs no model, so it pays where
outputs repeat their context (code edits, quoted documents, tool calls over earlier output).

Each request's positions are indexed by token as its tokens arrive (a dict of lists), so a lookup
reads the positions of its last token, latest first, instead of scanning the context. This file
never imports torch; the scheduler owns when drafts are asked for and how many fit.
"""
from __future__ import annotations

from rackserve.config import SpeculativeConfig

MAX_CANDIDATES = 64     # latest occurrences of the last token a lookup compares, at most


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.max_n = config.prompt_lookup_max
        self.min_n = config.prompt_lookup_min
        # req id -> (its positions by token, [how many of its tokens are indexed])
        self._index: dict[str, tuple[dict[int, list[int]], list[int]]] = {}

    def propose(self, req_id: str, tokens: list[int], max_drafts: int) -> list[int]:
        """Up to min(k, max_drafts) draft tokens to follow `tokens` (the request's prompt and
        outputs so far); [] when no n-gram of the allowed sizes occurs earlier."""
        want = min(self.k, max_drafts)
        if want <= 0 or len(tokens) <= self.min_n:
            return []
        positions, indexed = self._index.setdefault(req_id, ({}, [0]))
        end = len(tokens) - 1       # the last token is the pattern's end, not a candidate
        for p in range(indexed[0], end):
            positions.setdefault(tokens[p], []).append(p)
        indexed[0] = end
        best_len, best_at = 0, -1
        candidates = positions.get(tokens[-1], ())
        for p in reversed(candidates[-MAX_CANDIDATES:]):     # latest first: a longer match must be strictly longer
            n = 1
            while n < self.max_n and p - n >= 0 and tokens[p - n] == tokens[end - n]:
                n += 1
            if n > best_len:
                best_len, best_at = n, p
                if n == self.max_n:
                    break
        if best_len < self.min_n:
            return []
        return tokens[best_at + 1:best_at + 1 + want]

    def forget(self, req_id: str) -> None:
        self._index.pop(req_id, None)


class RunnerDrafts:
    """`"method": "mtp"`: the executor drafts, as vLLM's MTP and EAGLE drafters do after sampling.
    A step's ModelRunnerOutput carries, for each request that sampled, the tokens it drafts to follow
    them; they are proposed at the request's next decode, if its tokens are still the ones they
    follow (a request preempted, or cut by a stop, proposes nothing stale)."""

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self._drafts: dict[str, tuple[int, list[int]]] = {}   # req id -> (its tokens then, the drafts)

    def take(self, req_id: str, num_tokens: int, drafts: list[int]) -> None:
        """The executor's drafts to follow the request's first `num_tokens` tokens."""
        self._drafts[req_id] = (num_tokens, drafts)

    def propose(self, req_id: str, tokens: list[int], max_drafts: int) -> list[int]:
        num_tokens, drafts = self._drafts.pop(req_id, (-1, []))
        return drafts[:min(self.k, max_drafts)] if num_tokens == len(tokens) and max_drafts > 0 else []

    def forget(self, req_id: str) -> None:
        self._drafts.pop(req_id, None)
