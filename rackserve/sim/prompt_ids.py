"""A simulated prompt's token ids, straight from the workload's blocks: what bench's text would
tokenize to in the simulator (one word, one token), without rendering 142K-word prompts as text
and splitting them again on every request.

`Tokens` maps words to ids in the order they first appear (ids wrap at the vocabulary's size).
`BlockRenderer` is bench's PromptRenderer for the simulator: its messages carry `BlockText`
(the play marker and the (namespace, key) of each block) instead of text, and `Tokens.encode`
turns a block into ids once and reuses them, and a turn's prompt into its session's last prompt's ids
plus those of its new blocks. A block's words always get the same ids and are
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
# Ids kept of sessions' last prompts (4 bytes each, at most 4 GiB, held only as lanes need them):
# lanes meet their sessions in turn, so a memo smaller than the live sessions' prompts keeps nothing
# (the least recently met is the next met) and every turn walks its prompt's blocks, redrawing those
# the block LRU cycled out too. 1,792 lanes at AgentX's mean request prompt (284K tokens) hold ~510M
# ids; with 2^27 kept such a run spent over half its time there (py-spy). 2^30 holds ~3,700 lanes.
MAX_PROMPT_IDS = 1 << 30


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
        # A session's last prompt (its blocks and their ids) by its head and first block, the least
        # recently met dropped first: a turn extends its session's last prompt by a few blocks.
        self._prompts: OrderedDict[tuple, tuple[tuple, array]] = OrderedDict()
        self._prompt_ids = 0

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
        cut = bool(blocks) and content.last_words < content.renderer.block_size
        ids += self._whole_blocks(content.head, blocks[:-1] if cut else blocks, content.renderer)
        if cut:
            # A cut block assigns ids to the words it uses only, as its text would.
            key = blocks[-1]
            whole = cache.get(key)
            if whole is not None:
                cache.move_to_end(key)
            ids.extend(whole[:content.last_words] if whole is not None else
                       self._ids_of(content.renderer.block(*key)[:content.last_words]))
        return ids

    def _whole_blocks(self, head: str, blocks: tuple, renderer: PromptRenderer) -> array:
        """The ids of whole blocks: those of the last prompt that began with the same head and
        block, where these blocks extend its blocks, then each new block's (kept, or drawn)."""
        cache, memo = self._blocks, self._prompts
        key = (head, blocks[0]) if blocks else None
        last = memo.pop(key, None)
        if last is not None and len(last[0]) <= len(blocks) and blocks[:len(last[0])] == last[0]:
            ids, start = last[1], len(last[0])
        else:
            ids, start = array("I"), 0
        if last is not None:
            self._prompt_ids -= len(last[1])
        for block in blocks[start:]:
            whole = cache.get(block)
            if whole is not None:
                cache.move_to_end(block)
            else:
                if len(cache) >= MAX_CACHED_BLOCKS:   # a long run plays many sessions
                    cache.popitem(last=False)
                whole = cache[block] = array("I", self._ids_of(renderer.block(*block)))
            ids += whole
        if key is not None and len(ids) <= MAX_PROMPT_IDS:
            memo[key], self._prompt_ids = (blocks, ids), self._prompt_ids + len(ids)
            while self._prompt_ids > MAX_PROMPT_IDS:
                self._prompt_ids -= len(memo.popitem(last=False)[1][1])
        return ids

    def encode(self, messages: list[dict]) -> array:
        return self.template.wrap(messages, self._id, self._words)
