"""The tokenizer against references nobody here wrote: transformers' own GGUF tokenizer for the
real SmolLM2 file and for small synthetic GGUF files, and transformers' AutoTokenizer for HF
directories; plus llama.cpp's definition of the "smollm" pre-tokenizer where transformers lacks it.
"""
from __future__ import annotations

import json
import os
import threading
import time

import pytest
from tokenizers import Regex, Tokenizer, pre_tokenizers
from transformers import AutoTokenizer

from rackserve.config import smollm2_gguf_path
from rackserve.engine.tokenizer import PromptTooLongError, load_tokenizer
from tests.tokenizer_utils import save_test_gguf_tokenizer, save_test_tokenizer

TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; π ≈ 3.14159 and 1e-9 is small.",
    "naïve café — “quoted” ‘text’… Übergrößenträger",
    "日本語のテキストと中文文本, 한국어 문장, العربية, עברית, русский текст",
    "emoji 🙂🚀👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and skin tones 👍🏽",
    "tabs\tand\t\ttabs, spaces    between   words, trailing   ",
    "   leading spaces\n\nnew paragraph\r\nwindows line\n\n\n",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text <|im_end|>",
    "I'm sure they'll say it's what we've done; I'd've known.",
    "URLs: https://example.com/a?b=c&d=e#f and emails: a.b@c.org",
    "",
    " ",
    "\n",
]
# transformers maps no split to llama.cpp's "smollm" pre-tokenizer and falls back to GPT-2's,
# which differs only where a numeral follows whitespace: two or more whitespace characters before
# an ASCII digit (the vocabulary merges no digits), any before a multi-byte numeral.
NUMERAL_AFTER_WHITESPACE = ["  1", "x  2024", "\n\n1. first item\n2. second", "1\n 2", "   42   ",
                            "total:\t\t99", "numerals ① ② ³ ٣ Ⅻ 一二三"]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name 3 colours."}],
    [{"role": "user", "content": "Translate: café 🙂"}, {"role": "assistant", "content": "Café 🙂"},
     {"role": "user", "content": "Now in 日本語?"}],
]


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer(smollm2_gguf_path())


@pytest.fixture(scope="module")
def transformers_smollm2(gguf_py_memo):
    path = smollm2_gguf_path()
    with gguf_py_memo():
        return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.fixture(scope="module")
def llama_cpp_smollm2(transformers_smollm2):
    """transformers' GGUF tokenizer with llama.cpp's "smollm" split: each \\p{N} alone, then GPT-2's."""
    backend = Tokenizer.from_str(transformers_smollm2.backend_tokenizer.to_str())
    gpt2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        pre_tokenizers.Split(Regex(gpt2), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return backend


def test_gguf_encode_matches_transformers(smollm2, transformers_smollm2):
    for text in TEXTS:
        for special in (True, False):
            want = transformers_smollm2.encode(text, add_special_tokens=special)
            assert smollm2.encode(text, add_special_tokens=special) == want, text


def test_gguf_encode_matches_llama_cpp_smollm_split(smollm2, llama_cpp_smollm2):
    for text in TEXTS + NUMERAL_AFTER_WHITESPACE:
        assert smollm2.encode(text) == llama_cpp_smollm2.encode(text).ids, text
    # A numbered list keeps its paragraph break as one token, as the model saw it in training.
    assert smollm2.encode("\n\n1.")[0] == smollm2.encode("\n\n")[0]


def test_gguf_decode_and_token_text_match_transformers(smollm2, transformers_smollm2):
    for text in TEXTS:
        ids = transformers_smollm2.encode(text)
        for skip in (True, False):
            assert smollm2.decode(ids, skip_special_tokens=skip) == \
                transformers_smollm2.decode(ids, skip_special_tokens=skip), text
    for token_id in [0, 1, 2, 17, 198, 216, 1000, 30000, smollm2.vocab_size - 1]:
        assert smollm2.token_text(token_id) == transformers_smollm2.decode([token_id])


def test_gguf_special_tokens_and_sizes(smollm2, transformers_smollm2):
    assert smollm2.vocab_size == len(transformers_smollm2) == 49152
    assert smollm2.eos_token_ids == frozenset({transformers_smollm2.eos_token_id}) == frozenset({2})
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(smollm2.hf, name) == getattr(transformers_smollm2, name), name
    assert smollm2.encode("<|im_start|>user") == [1, 4093]


def test_gguf_chat_template_matches_transformers(smollm2, transformers_smollm2):
    for messages in CONVERSATIONS:
        for gen in (True, False):
            want = transformers_smollm2.apply_chat_template(messages, add_generation_prompt=gen,
                                                            tokenize=True, return_dict=False)
            assert smollm2.apply_chat_template(messages, add_generation_prompt=gen) == want


# "smollm" is covered by the real file above: this vocabulary merges digits, SmolLM2's never does.
@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2"])
def test_synthetic_gguf_matches_transformers(tmp_path, pre):
    save_test_gguf_tokenizer(str(tmp_path / "tok.gguf"), 400, pre)
    ours = load_tokenizer(str(tmp_path / "tok.gguf"))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tok.gguf")
    assert ours.vocab_size == len(ref) == 400
    for text in TEXTS + NUMERAL_AFTER_WHITESPACE + ["a<think>b</think> <tool call>c"]:
        assert ours.encode(text) == ref.encode(text), (pre, text)   # BOS added: add_bos_token is set
        assert ours.decode(ref.encode(text)) == ref.decode(ref.encode(text), skip_special_tokens=True)
    assert ours.apply_chat_template(CONVERSATIONS[2]) == ref.apply_chat_template(
        CONVERSATIONS[2], add_generation_prompt=True, tokenize=True, return_dict=False)


def test_unknown_gguf_pre_tokenizer_is_refused(tmp_path):
    save_test_gguf_tokenizer(str(tmp_path / "tok.gguf"), 300, "no-such-pre")
    with pytest.raises(NotImplementedError, match="no-such-pre"):
        load_tokenizer(str(tmp_path / "tok.gguf"))


def test_hf_directory_matches_autotokenizer(tmp_path):
    save_test_tokenizer(str(tmp_path), 512)
    ours = load_tokenizer(str(tmp_path))
    ref = AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.vocab_size == len(ref) <= 512
    assert ours.eos_token_ids == frozenset({ref.convert_tokens_to_ids("<|im_end|>")})
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    for messages in CONVERSATIONS:
        assert ours.apply_chat_template(messages) == ref.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def test_hf_directory_generation_config_eos_and_template_json(tmp_path):
    save_test_tokenizer(str(tmp_path), 512)
    template = (tmp_path / "chat_template.jinja").read_text()
    os.remove(tmp_path / "chat_template.jinja")
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    tok = load_tokenizer(str(tmp_path))
    assert tok.eos_token_ids == frozenset({0, 2})
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(ids, skip_special_tokens=False) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_long_text_is_tokenized_without_holding_the_gil(smollm2):
    """Before: Tokenizer.encode held the GIL for the whole Rust call, so a long prompt tokenized
    in a worker thread stalled the server's event loop and engine thread (a chat of 300k empty
    messages: 2.1M tokens, seconds). Another thread now runs while it tokenizes."""
    text = "1" * 200_000   # a token a digit: ~1 s on a Zen 3 vCPU, niced
    started, ticks = threading.Event(), []

    def tokenize() -> None:
        started.set()
        assert len(smollm2.encode(text, add_special_tokens=False)) == len(text)

    worker = threading.Thread(target=tokenize)
    worker.start()
    started.wait()
    while worker.is_alive():
        time.sleep(0.001)
        ticks.append(1)
    worker.join()
    assert len(ticks) >= 10, f"this thread ran {len(ticks)} times while the text was tokenized"


def test_a_conversation_that_cannot_fit_is_refused_before_it_is_tokenized(smollm2, monkeypatch):
    """Its message count before rendering (a token a message at least), its rendered text before
    tokenizing (check_fits' bound): neither spends the tokenizer on it."""
    with pytest.raises(PromptTooLongError, match="of 9 messages"):
        smollm2.check_messages_fit(9, 8)
    smollm2.check_messages_fit(8, 8)
    monkeypatch.setattr(smollm2, "encode", lambda *a, **k: pytest.fail("tokenized a prompt known not to fit"))
    # Each message's text passes the character bound by itself; with its role markers it does not.
    content = "x" * (smollm2.max_token_chars - 1)
    with pytest.raises(PromptTooLongError, match="characters"):
        smollm2.apply_chat_template([{"role": "user", "content": content}] * 8, max_len=8)
