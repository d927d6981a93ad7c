"""Token blocks as text: deterministic blocks, prompts that extend as their hash ids do, and words
that a real tokenizer turns back into exactly one token each (so prompt lengths are exact)."""
from __future__ import annotations

import pytest

from rackserve.bench.token_text import (PromptRenderer, default_vocabulary, load_server_tokenizer, render,
                                        vocabulary_from_tokenizer)
from tests.tokenizer_utils import save_test_tokenizer


def test_blocks_are_deterministic_and_namespaced():
    a, b = PromptRenderer(default_vocabulary(), seed=1), PromptRenderer(default_vocabulary(), seed=1)
    assert a.block("trace-1", 7) == b.block("trace-1", 7) and len(a.block("trace-1", 7)) == 64
    assert a.block("trace-1", 7) != a.block("trace-2", 7) != a.block("trace-1", 8)
    assert PromptRenderer(default_vocabulary(), seed=2).block("trace-1", 7) != a.block("trace-1", 7)


def test_a_prompt_extends_the_one_before_it():
    r = PromptRenderer(default_vocabulary(), seed=0)
    # Same ids, more tokens (the partial last block fills up): the text extends.
    _, short = r.prompt([4, 5, 6], 150, "t", 0)
    _, long = r.prompt([4, 5, 6, 9], 200, "t", 0)
    assert long.startswith(short) and len(short.split()) == 150 and len(long.split()) == 200
    # A re-hashed last block: only the whole blocks before it are shared.
    _, other = r.prompt([4, 5, 8], 150, "t", 0)
    assert other.split()[:128] == short.split()[:128] and other.split()[128:] != short.split()[128:]


def test_shared_blocks_come_from_the_position_not_the_namespace():
    r = PromptRenderer(default_vocabulary(), seed=0)
    shared_a, own_a = r.prompt([10, 11, 12], 170, "a", 2)
    shared_b, own_b = r.prompt([90, 91, 92], 170, "b", 2)
    assert shared_a == shared_b and len(shared_a.split()) == 128
    assert own_a != own_b and len(own_a.split()) == 42


def test_tokenizer_vocabulary_gives_one_token_per_word(tmp_path):
    save_test_tokenizer(str(tmp_path), 512)
    tokenizer = load_server_tokenizer(str(tmp_path))
    vocabulary = vocabulary_from_tokenizer(tokenizer, "test")
    assert vocabulary.exact and len(vocabulary.words) >= 16
    _, text = PromptRenderer(vocabulary, seed=0).prompt(range(5), 300, "t", 0)
    assert len(tokenizer.encode(text, add_special_tokens=False)) == 300


def test_default_words_are_single_tokens_of_smollm2():
    tokenizer = load_server_tokenizer("smollm2-135m-instruct")
    words = default_vocabulary().words
    assert len(set(words)) == len(words) == 256
    assert tokenizer.encode(render(words), add_special_tokens=False) == [
        tokenizer.encode(" " + w, add_special_tokens=False)[0] for w in words]


def test_a_tokenizer_without_single_token_words_is_refused(tmp_path):
    save_test_tokenizer(str(tmp_path), 259)     # bytes and special tokens only: no merges
    with pytest.raises(ValueError, match="single-token words"):
        vocabulary_from_tokenizer(load_server_tokenizer(str(tmp_path)), "test")
