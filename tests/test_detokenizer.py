"""Incremental detokenization on real SmolLM2 tokenizations: the stream adds up to a full decode and
never shows a half character; stop strings cut the text (also across token boundaries), hold
back a tail that may still become one, and release it at the end."""
from __future__ import annotations

import random

import pytest

from rackserve.config import smollm2_gguf_path
from rackserve.engine.detokenizer import IncrementalDetokenizer
from rackserve.engine.tokenizer import Tokenizer, load_tokenizer
from rackserve.sampling_params import SamplingParams
from tests.tokenizer_utils import train_test_metaspace_tokenizer

UNICODE_TEXTS = [
    "Grüße aus Köln! Ça va? naïve café — “quotes” … 😀🚀👨‍👩‍👧 done",
    "日本語のテキストと中文文本。한국어 문장도 있습니다. Ελληνικά, русский, עברית, हिन्दी",
    "Math: ∀x∈ℝ, x²≥0; ∑ᵢ aᵢ → ∞. Arrows ⟶ ⟹ and boxes ┌─┐ │ └─┘ 🇯🇵🇫🇷",
    "code:\n    def f(x):\n        return x ** 2  # ✓\n\n\n\ttabs   and   spaces 12345",
]
PROMPT = "<|im_start|>user\nWrite something<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(smollm2_gguf_path())


def stream(tok, ids: list[int], chunks: list[int] | None = None, finish: bool = True,
           prompt: str = PROMPT, **params) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed ids in chunks (default one at a time); the last chunk is marked finished if `finish`."""
    detok = IncrementalDetokenizer(tok, tok.encode(prompt), SamplingParams(**params))
    chunks = chunks or [1] * len(ids)
    assert sum(chunks) == len(ids)
    deltas, start = [], 0
    for i, n in enumerate(chunks):
        deltas.append(detok.update(ids[start:start + n], finished=finish and i == len(chunks) - 1))
        start += n
    assert "".join(deltas) == detok.output_text
    return deltas, detok


@pytest.mark.parametrize("text", UNICODE_TEXTS, ids=["latin-emoji", "scripts", "math-symbols", "code-spaces"])
def test_stream_adds_up_to_the_full_decode_without_replacement_chars(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    deltas, _ = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    rng = random.Random(len(text))
    chunks = []
    while sum(chunks) < len(ids):
        chunks.append(min(rng.randint(1, 4), len(ids) - sum(chunks)))
    assert "".join(stream(tok, ids, chunks)[0]) == text


def test_characters_split_across_tokens_wait_for_their_last_byte(tok):
    ids = tok.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1, "the rocket must span tokens for this test to mean anything"
    assert stream(tok, ids)[0] == [""] * (len(ids) - 1) + ["🚀"]


def test_unfinished_character_is_flushed_at_finish_like_a_full_decode(tok):
    ids = tok.encode("ok 🚀", add_special_tokens=False)[:-1]
    assert "".join(stream(tok, ids)[0]) == tok.decode(ids) == "ok \ufffd"


def test_stop_string_spanning_tokens_cuts_before_it(tok):
    text = "The answer is 42. END OF STORY and then more text"
    ids = tok.encode(text, add_special_tokens=False)
    assert not any("END OF" in tok.decode([i]) for i in ids), "the stop string must span tokens"
    deltas, detok = stream(tok, ids, finish=False, stop=["END OF"])
    assert detok.stop_string == "END OF"
    assert "".join(deltas) == "The answer is 42. "
    assert detok.update(tok.encode(" ignored"), finished=False) == ""


def test_include_stop_str_in_output_keeps_it(tok):
    ids = tok.encode("The answer is 42. END OF STORY and more", add_special_tokens=False)
    deltas, detok = stream(tok, ids, finish=False, stop=["END OF"], include_stop_str_in_output=True)
    assert "".join(deltas) == "The answer is 42. END OF"
    assert detok.stop_string == "END OF"


def test_earliest_stop_string_wins(tok):
    ids = tok.encode("alpha beta gamma", add_special_tokens=False)
    deltas, detok = stream(tok, ids, chunks=[len(ids)], finish=False, stop=["gamma", "beta"])
    assert "".join(deltas) == "alpha " and detok.stop_string == "beta"


def test_possible_stop_prefix_is_held_back_until_finish(tok):
    ids = tok.encode("Say STO", add_special_tokens=False)
    deltas, detok = stream(tok, ids, finish=False, stop=["STOP"])
    assert "".join(deltas) == "Say "            # "STO" may still become "STOP"
    assert detok.update([], finished=True) == "STO"
    assert detok.stop_string is None and detok.output_text == "Say STO"


def test_held_back_prefix_is_released_once_it_diverges(tok):
    ids = tok.encode("Say STOMP now", add_special_tokens=False)
    deltas, detok = stream(tok, ids, finish=False, stop=["STOP"])
    assert "".join(deltas) == "Say STOMP now"
    assert detok.stop_string is None


def test_skip_special_tokens(tok):
    ids = tok.encode("Hi<|im_end|>\nthere", add_special_tokens=False)
    assert "".join(stream(tok, ids)[0]) == "Hi\nthere"
    assert "".join(stream(tok, ids, skip_special_tokens=False)[0]) == "Hi<|im_end|>\nthere"


def test_terminating_eos_adds_no_text_unless_stop_strings_are_included(tok):
    eos = next(iter(tok.eos_token_ids))
    ids = tok.encode("Done.", add_special_tokens=False) + [eos]
    assert "".join(stream(tok, ids, skip_special_tokens=False)[0]) == "Done."
    assert "".join(stream(tok, ids, skip_special_tokens=False, include_stop_str_in_output=True)[0]) == \
        "Done.<|im_end|>"
    assert "".join(stream(tok, ids, skip_special_tokens=False, ignore_eos=True)[0]) == "Done.<|im_end|>"


def test_first_token_keeps_its_leading_space_with_a_metaspace_tokenizer():
    hf = train_test_metaspace_tokenizer(300)
    metaspace = Tokenizer(hf, frozenset({hf.eos_token_id}))
    ids = metaspace.encode(" brown fox jumps")
    assert metaspace.decode(ids) == "brown fox jumps", "decoding alone drops the leading space"
    deltas, _ = stream(metaspace, ids, prompt="The quick")
    assert "".join(deltas) == " brown fox jumps"
