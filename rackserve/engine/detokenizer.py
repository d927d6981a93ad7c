"""IncrementalDetokenizer: one request's generated token ids -> streamable text, with stop strings.

Decoding keeps vLLM's prefix/read offsets: the text of ids[prefix:] minus the text of
ids[prefix:read] is new only when it does not end in U+FFFD, so a character split across tokens
is released whole, once its last byte arrives. The last few prompt tokens seed the window, so the
first generated token decodes as it would mid-text (SentencePiece drops a leading space otherwise).

Stop strings: on a match the text is cut before the stop string (after it with
include_stop_str_in_output) and `stop_string` is set; the caller must then finish the request.
While running, a tail that could still grow into a stop string is held back; finishing releases it.
A stop token or EOS that ends the request adds no text unless include_stop_str_in_output, as in vLLM.

This file owns text assembly for one request. It must never decide token-level stops (EOS, stop
token ids, max_tokens: core/request.py does) or touch the engine.
"""
from __future__ import annotations

from rackserve.engine.tokenizer import Tokenizer
from rackserve.sampling_params import SamplingParams

# Prompt tokens decoded ahead of the output as context (vLLM uses 5).
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stops = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        self._terminators = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._terminators |= tokenizer.eos_token_ids
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._text = ""                  # all text decoded from the output so far, released or not
        self.output_text = ""            # the part released to the caller
        self.stop_string: str | None = None

    def update(self, new_token_ids: list[int], finished: bool) -> str:
        """Take the step's new token ids; return the text that became releasable."""
        if self.stop_string is not None:
            return ""       # tokens that raced the abort of a request already stopped by text
        ids = new_token_ids
        if finished and ids and ids[-1] in self._terminators and not self._include_stop:
            ids = ids[:-1]
        self._ids.extend(ids)
        checked = len(self._text)
        self._text += self._decode_new(flush=finished)
        if self._stops and self._cut_at_stop_string(checked):
            return self._release(len(self._text))
        return self._release(len(self._text) if finished else len(self._text) - self._held_back())

    def _decode_new(self, flush: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset], self._skip_special)
        full_text = decode(self._ids[self._prefix_offset:], self._skip_special)
        if len(full_text) <= len(prefix_text) and not flush:
            return ""       # only tokens that decode to nothing (skipped specials) so far
        if full_text.endswith("\ufffd") and not flush:
            return ""       # a character is still missing bytes
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full_text[len(prefix_text):]

    def _cut_at_stop_string(self, checked: int) -> bool:
        """Find the earliest stop string ending in the text new since `checked`; cut there."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            at = self._text.find(stop, max(0, checked - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        at, stop = best
        self._text = self._text[:at + len(stop) if self._include_stop else at]
        assert len(self._text) >= len(self.output_text), "released text never holds a stop string"
        self.stop_string = stop
        return True

    def _held_back(self) -> int:
        """Length of the longest tail that is a proper prefix of a stop string (0 when the stop
        string is part of the output anyway: then nothing can be retracted)."""
        if not self._stops or self._include_stop:
            return 0
        held = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._text)), held, -1):
                if self._text.endswith(stop[:n]):
                    held = n
                    break
        assert held <= len(self._text) - len(self.output_text), "a held tail was already released"
        return held

    def _release(self, upto: int) -> str:
        delta = self._text[len(self.output_text):upto]
        self.output_text += delta
        return delta
