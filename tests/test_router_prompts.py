"""Tokenize once (router/prompts.py): what the router forwards carries the very token ids the
instance would have made from the text (completions: the prompt itself; chat: the rendered
conversation as `prompt_token_ids`), and a body it cannot read goes on untouched, for the
instance to refuse in its own words."""
from __future__ import annotations

import pytest

from rackserve.engine.tokenizer import load_tokenizer
from rackserve.router.prompts import render
from tests.tokenizer_utils import save_test_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok"))
    save_test_tokenizer(path, 512)
    return load_tokenizer(path)


def test_completion_prompts_go_as_token_ids(tokenizer):
    text = "Caches keep the keys and values of earlier tokens"
    ids, body = render(tokenizer, "/v1/completions", {"model": "m", "prompt": text, "max_tokens": 3})
    assert ids == tokenizer.encode(text) and body == {"model": "m", "prompt": ids, "max_tokens": 3}
    batch = {"model": "m", "prompt": ["one two", "three"]}
    ids, body = render(tokenizer, "/v1/completions", batch)
    assert ids == tokenizer.encode("one two") and body["prompt"] == [ids, tokenizer.encode("three")]
    ids, body = render(tokenizer, "/v1/completions", {"model": "m", "prompt": [5, 6, 7]})
    assert ids == [5, 6, 7] and body["prompt"] == [5, 6, 7]


def test_chat_goes_with_the_rendered_conversation(tokenizer):
    chat = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}
    ids, body = render(tokenizer, "/v1/chat/completions", chat)
    assert ids == tokenizer.apply_chat_template([{"role": "user", "content": "hello there"}])
    assert body == {**chat, "prompt_token_ids": ids}


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "m", "prompt": ""}),                        # empty: the instance says so
    ("/v1/completions", {"model": "m"}),                                      # no prompt
    ("/v1/chat/completions", {"model": "m", "messages": "not a list"}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "assistant"}, {"role": "robot"}]}),
])
def test_what_the_router_cannot_tokenize_goes_on_as_it_came(tokenizer, path, body):
    assert render(tokenizer, path, body).body is body


def test_a_conversation_rendered_past_the_instances_bound_goes_on_untokenized(tokenizer, monkeypatch):
    """Its messages pass the character bound, its rendered text does not: the router's tokenizer
    is not spent on it (the instance refuses it in its own words)."""
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: pytest.fail("tokenized a prompt known not to fit"))
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * (tokenizer.max_token_chars - 1)}] * 4}
    assert render(tokenizer, "/v1/chat/completions", body, max_len=4).body is body
