"""A simulated prompt's token ids, straight from the workload's blocks: what bench's text would
tokenize to in the simulator (one word, one token), without rendering 142K-word prompts as text
and splitting them again on every request.

`Tokens` maps words to ids in the order they first appear (ids wrap at the vocabulary's size).
`BlockRenderer` is bench's PromptRenderer for the simulator: its messages carry `BlockText`
(the play marker and the (namespace, key) of each block) instead of text, and `Tokens.encode`
turns a block into ids once and reuses them. A block's words always get the same ids and are
met in the text's order, so the ids are exactly the text path's (tests/test_sim_speed.py
checks it). The head (bench's play marker) is no workload text: it takes the server tokenizer's
tokens where `Tokens` is given them (chat_template.marker_ids), as a served prompt does. This file owns that mapping; it must never decide token counts (workloads do) nor
step an engine.
"""
from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple

from rackserve.bench.token_text import PromptRenderer
from rackserve.sim.chat_template import TemplateTokens

# Blocks whose ids are kept, least recently used evicted first: 384 full-size AgentX lanes met
# 1.03M distinct 64-word blocks in 287 simulated seconds, and the prompts of live sessions are
# encoded again every turn. A lane's live session holds ~2,900-4,400 blocks (AgentX's median and
# mean prompt), so a rack's 768 lanes need ~3.4M kept or every turn draws its prompt again (an
# LRU cycled by more than it holds keeps nothing). At ~590 bytes a kept block (its 4-byte array, key
# and entry; measured), 2^22 are at most ~2.5 GB.
MAX_CACHED_BLOCKS = 1 << 22


class BlockText(NamedTuple):
    """A message's content as `head`'s words, then the words of `blocks` ((namespace, key) each),
    the last one cut to `last_words` words."""
    head: str
    blocks: tuple[tuple[str, int], ...]
    last_words: int
    renderer: PromptRenderer


class BlockRenderer(PromptRenderer):
    """PromptRenderer whose messages are BlockText: the same prompts, as blocks."""

    def messages(self, hash_ids: Sequence[int], num_tokens: int, namespace: str, shared_blocks: int,
                 marker: str) -> list[dict]:
        shared, own, last = self.blocks(hash_ids, num_tokens, namespace, shared_blocks)
        messages = [{"role": "system", "content": BlockText("", tuple(shared), last if not own else self.block_size,
                                                            self)}] if shared else []
        messages.append({"role": "user", "content": BlockText(marker, tuple(own), last, self)})
        return messages


class Tokens:
    """Word -> token id, stable within a simulation: one word of bench's prompt text is one token,
    inside the chat template's own tokens (chat_template.py). Ids wrap at the vocabulary's size,
    so a real model can take them too (a step trace)."""

    def __init__(self, vocab_size: int, template: TemplateTokens = TemplateTokens(),
                 marker: Callable[[str], Sequence[int]] | None = None) -> None:
        self.ids: dict[str, int] = {}
        self.vocab_size, self.template, self.marker = vocab_size, template, marker
        self._blocks: OrderedDict[tuple[str, int], array] = OrderedDict()    # a whole block's ids

    def _id(self, word: str) -> int:
        return self.ids.setdefault(word, len(self.ids) % self.vocab_size)

    def _ids_of(self, words: Sequence[str]) -> list[int]:
        try:        # every word already has its id (the usual case: a vocabulary of 256 words)
            return list(map(self.ids.__getitem__, words))
        except KeyError:
            return [self._id(w) for w in words]

    def _words(self, content: "str | BlockText") -> "list[int] | array":
        if isinstance(content, str):
            return [self._id(w) for w in content.split()]
        if self.marker is not None and content.head:    # the server's tokens, in their own id names
            ids = array("I", [self._id(f"<marker {t}>") for t in self.marker(content.head)])
        else:
            ids = array("I", [self._id(w) for w in content.head.split()])
        blocks, cache = content.blocks, self._blocks
        for i, key in enumerate(blocks):
            whole = cache.get(key)
            if whole is not None:
                cache.move_to_end(key)
            if i == len(blocks) - 1 and content.last_words < content.renderer.block_size:
                # A cut block assigns ids to the words it uses only, as its text would.
                ids.extend(whole[:content.last_words] if whole is not None else
                           self._ids_of(content.renderer.block(*key)[:content.last_words]))
                continue
            if whole is None:
                if len(cache) >= MAX_CACHED_BLOCKS:   # a long run plays many sessions
                    cache.popitem(last=False)
                whole = cache[key] = array("I", self._ids_of(content.renderer.block(*key)))
            ids += whole
        return ids

    def encode(self, messages: list[dict]) -> array:
        return self.template.wrap(messages, self._id, self._words)
