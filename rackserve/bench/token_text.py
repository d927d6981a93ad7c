"""Token blocks as prompt text, so that a workload's blocks of token ids reach a chat API, which
takes text, and come back from the server's tokenizer as the same tokens every time.

A block of 64 token ids becomes 64 words of a vocabulary in which each word, after a space, is one
token (" the", " cache"). Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) and SentencePiece split
text at spaces before they merge, so " w1 w2 ... wn" tokenizes as the words' tokens one after
another: equal blocks give equal tokens on the server, a prompt that extends another re-tokenizes
as an extension of its tokens, and the server's prefix cache sees exactly the sharing the workload
describes. The default words are single tokens in SmolLM2's vocabulary (and common English words,
so single tokens in most BPE vocabularies of 32K and more); `vocabulary_from_tokenizer` picks words
checked against the server's own tokenizer, which makes prompt token counts exact.

This file owns the vocabulary and the rendering of blocks as text. It must never decide token
counts (workloads do) nor talk to a server.
"""
from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rackserve.engine.tokenizer import Tokenizer

BLOCK_SIZE = 64                 # tokens per hash id, as in the weka traces
SHARED_NAMESPACE = "shared"     # the namespace of blocks every session shares (a system prompt)

DEFAULT_WORDS = tuple("""
the of and to in is that for it as was with be by on not he this are or his from at which
but have an had they you were their one all we can her has there been if more when will
would who so no about out up them what some could into than then other time only new these
may do first any my now such like our over man me even most made after also did many before
must through back years where much your way well down should because each just those people
how too little state good very make world still own see men work long get here between both
life being under never day same another know while last might great old year off come since
against go came right used take three states himself few house use during without again
place american around however home small found thought went say part once general high upon
school every does got united left number course war until always away something fact though
water less public put think almost hand enough far took head yet government system better
set told nothing night end why called find going look asked later knew point next program
city business give group toward young days let room president side social given present
several order national possible rather second face per among form important often things
looked early white case large become big need four within felt along children saw best
church ever least power
""".split())


@dataclass(frozen=True)
class Vocabulary:
    words: tuple[str, ...]
    exact: bool                 # every word was checked to be one token of the server's tokenizer
    source: str


def default_vocabulary() -> Vocabulary:
    return Vocabulary(DEFAULT_WORDS, exact=False, source="built-in English words")


def load_server_tokenizer(path: str) -> "Tokenizer":
    """The server's tokenizer, from a .gguf file, an HF directory or a rackserve model alias."""
    from rackserve.config import resolve_model_path
    from rackserve.engine.tokenizer import load_tokenizer
    return load_tokenizer(resolve_model_path(path))


def vocabulary_from_tokenizer(tokenizer: "Tokenizer", source: str, max_words: int = 4096) -> Vocabulary:
    """Words that are one token each, after a space, in `tokenizer`."""
    # "Ġ" is byte-level BPE's space, "▁" SentencePiece's.
    pattern = re.compile("[\u0120\u2581]([a-z]{2,12})")
    words = []
    for piece, token_id in sorted(tokenizer.hf.get_vocab().items(), key=lambda kv: kv[1]):
        match = pattern.fullmatch(piece)
        if match and tokenizer.encode(" " + match[1], add_special_tokens=False) == [token_id]:
            words.append(match[1])
        if len(words) == max_words:
            break
    if len(words) < 16:
        raise ValueError(f"the tokenizer {source} has only {len(words)} single-token words; "
                         "use the built-in vocabulary instead")
    # Words that merge across the space would break the one-word-one-token rule: check them all.
    if len(tokenizer.encode(render(words), add_special_tokens=False)) != len(words):
        raise ValueError(f"the tokenizer {source} merges tokens across spaces; use the built-in vocabulary")
    return Vocabulary(tuple(words), exact=True, source=f"single-token words of {source}")


def render(words: Sequence[str]) -> str:
    return "".join(" " + w for w in words)


class PromptRenderer:
    """Deterministic text for hash-id blocks: block (namespace, id) is the same 64 words for a
    given vocabulary and seed, in every process and on every run."""

    def __init__(self, vocabulary: Vocabulary, seed: int, block_size: int = BLOCK_SIZE):
        self.vocabulary = vocabulary
        self.seed = seed
        self.block_size = block_size
        self._blocks: dict[tuple[str, int], tuple[str, ...]] = {}

    def block(self, namespace: str, key: int) -> tuple[str, ...]:
        words = self._blocks.get((namespace, key))
        if words is None:
            digest = blake2b(f"{self.seed}/{namespace}/{key}".encode(), digest_size=8).digest()
            words = tuple(random.Random(int.from_bytes(digest, "little")).choices(
                self.vocabulary.words, k=self.block_size))
            if len(self._blocks) > 1 << 16:     # a long run plays many sessions: bound the memory
                self._blocks.clear()
            self._blocks[(namespace, key)] = words
        return words

    def blocks(self, hash_ids: Sequence[int], num_tokens: int, namespace: str, shared_blocks: int
               ) -> tuple[list[tuple[str, int]], list[tuple[str, int]], int]:
        """The blocks of a prompt of `num_tokens` tokens as (shared keys, own keys, words of the
        last block): its first `shared_blocks` blocks come from the shared namespace by position,
        the rest from `namespace` by hash id; the last block may be partial (a prefix of its block)."""
        assert 0 <= num_tokens <= len(hash_ids) * self.block_size, "hash ids do not cover the prompt"
        count = -(-num_tokens // self.block_size)
        last = num_tokens - (count - 1) * self.block_size if count else 0
        shared = [(SHARED_NAMESPACE, position) for position in range(min(shared_blocks, count))]
        own = [(namespace, key) for key in hash_ids[len(shared):count]]
        return shared, own, last

    def prompt(self, hash_ids: Sequence[int], num_tokens: int, namespace: str,
               shared_blocks: int) -> tuple[str, str]:
        """The text of a prompt of `num_tokens` tokens as (shared part, own part) (see `blocks`)."""
        shared, own, last = self.blocks(hash_ids, num_tokens, namespace, shared_blocks)
        keys = shared + own
        parts: tuple[list[str], list[str]] = ([], [])
        for i, key in enumerate(keys):
            words = self.block(*key)
            parts[0 if i < len(shared) else 1].extend(words[:last] if i == len(keys) - 1 else words)
        return render(parts[0]), render(parts[1])

    def messages(self, hash_ids: Sequence[int], num_tokens: int, namespace: str, shared_blocks: int,
                 marker: str) -> list[dict]:
        """The chat messages of a prompt: the shared part as the system message (when there is
        one), then `marker` and the prompt's own part as the user's."""
        shared, own = self.prompt(hash_ids, num_tokens, namespace, shared_blocks)
        messages = [{"role": "system", "content": shared}] if shared else []
        messages.append({"role": "user", "content": marker + own})
        return messages
