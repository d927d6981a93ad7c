"""Tokenizer: text <-> token ids for one model, loaded from a GGUF file or an HF directory.

A GGUF file carries no tokenizer.json, only llama.cpp's metadata (tokens, merges, token types,
special ids, the name of a pre-tokenizer). We build the `tokenizers.Tokenizer` those describe
ourselves (0.3 s for SmolLM2 once the file is open, against ~5 s for transformers' GGUF path)
and wrap it in transformers' PreTrainedTokenizerFast so chat templates render exactly as
transformers renders them. The pre-tokenizer follows llama.cpp's definition of each
`tokenizer.ggml.pre` name, since llama.cpp is what the file was written for.

This file owns tokenization and chat-template rendering. It must never decode incrementally
(that is engine/detokenizer.py) and never download anything.
"""
from __future__ import annotations

import functools

import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer

if TYPE_CHECKING:
    import transformers

# llama.cpp's token types (tokenizer.ggml.token_type).
_CONTROL = 3
_USER_DEFINED = 4

# llama.cpp's split regexes, by the pre-tokenizer names GGUF files carry.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Each digit stands alone, then GPT-2's split: SmolLM's and StarCoder's tokenizer.json say so.
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_GPT2 = ("gpt-2", "mpt", "olmo", "jais")
_LLAMA3 = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3", "pixtral")
_QWEN2 = ("qwen2", "deepseek-r1-qwen")


class PromptTooLongError(ValueError):
    """A prompt or conversation known, before tokenizing it, to exceed the context."""


class Tokenizer:
    """One model's tokenizer. `hf` is the wrapped transformers tokenizer; encode and decode go
    straight to its Rust backend (byte-exact text: no clean-up of spaces, as vLLM streams)."""

    def __init__(self, hf: "transformers.PreTrainedTokenizerFast", eos_token_ids: frozenset[int]):
        assert eos_token_ids, "a tokenizer needs at least one end-of-sequence token"
        self.hf = hf
        self._backend: RustTokenizer = hf.backend_tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size: int = len(hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, not encode: only the batch call lets go of the GIL while Rust works, and a
        # long text (a conversation of 300k empty messages renders to 2.1M tokens: seconds) would
        # otherwise hold the server's event loop and engine thread from a worker thread.
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            add_special_tokens: bool = False, max_len: int | None = None) -> list[int]:
        """The conversation's prompt ids; with `max_len`, raises PromptTooLongError when the
        rendered text is too long for any prompt of max_len tokens, before tokenizing it."""
        if not self.hf.chat_template:
            raise ValueError("this model has no chat template; use the completions API instead")
        # Templates write BOS and friends themselves, so the text is encoded without adding them
        # (transformers does the same when it tokenizes a rendered template).
        text = self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                           tokenize=False)
        if max_len is not None:
            self.check_fits(len(text), max_len)
        return self.encode(text, add_special_tokens=add_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self._backend.decode([token_id], skip_special_tokens=False)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry, in characters: a text of more than max_len times this
        many characters cannot fit in max_len tokens, which is known without tokenizing it."""
        return max(1, max(map(len, self._backend.get_vocab(with_added_tokens=True))))

    def check_fits(self, num_chars: int, max_len: int) -> None:
        """Raises PromptTooLongError when a text of `num_chars` characters must exceed `max_len` tokens."""
        if num_chars > max_len * self.max_token_chars:
            raise PromptTooLongError(f"This model's maximum context length is {max_len} tokens; a prompt "
                                     f"of {num_chars} characters is longer than any prompt of {max_len} "
                                     "tokens can be. Please reduce the length of the prompt.")

    @staticmethod
    def check_messages_fit(num_messages: int, max_len: int) -> None:
        """Raises PromptTooLongError when a conversation of `num_messages` messages must exceed
        `max_len` tokens: a chat template writes each message's role markers, a token at least.
        Known before rendering, which costs ~17 us a message (300k empty ones: 5 s of Python)."""
        if num_messages > max_len:
            raise PromptTooLongError(f"This model's maximum context length is {max_len} tokens; a "
                                     f"conversation of {num_messages} messages is longer than that (a chat "
                                     "template writes at least one token for each message). Please reduce "
                                     "the number of messages.")


def load_tokenizer(path: str) -> Tokenizer:
    """From a .gguf file (its metadata: rackserve/gguf_file.py) or an HF directory holding
    tokenizer.json."""
    if os.path.isdir(path):
        return _load_hf_dir(path)
    if path.endswith(".gguf"):
        return _load_gguf(path)
    raise ValueError(f"tokenizer path {path!r} is neither a .gguf file nor a directory")


def _load_hf_dir(path: str) -> Tokenizer:
    from transformers import PreTrainedTokenizerFast
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise FileNotFoundError(f"{path} has no tokenizer.json (only fast tokenizers are supported)")
    # The base class, not AutoTokenizer: a model-specific class may rebuild the pipeline from
    # vocab and merges, while tokenizer.json is the source of truth.
    hf = PreTrainedTokenizerFast.from_pretrained(path, clean_up_tokenization_spaces=False)
    if not hf.chat_template:
        # transformers reads the template from tokenizer_config.json (and, in recent versions,
        # chat_template.jinja) but never from a processor-style chat_template.json.
        hf.chat_template = _read_chat_template_file(path)
    eos = {hf.eos_token_id} if hf.eos_token_id is not None else set()
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            gen_eos = json.load(f).get("eos_token_id")
        if gen_eos is not None:
            eos |= set(gen_eos) if isinstance(gen_eos, list) else {gen_eos}
    return Tokenizer(hf, frozenset(eos))


def _read_chat_template_file(path: str) -> str | None:
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja) as f:
            return f.read()
    js = os.path.join(path, "chat_template.json")
    if os.path.isfile(js):
        with open(js) as f:
            return json.load(f)["chat_template"]
    return None


def _load_gguf(path: str) -> Tokenizer:
    from transformers import PreTrainedTokenizerFast

    from rackserve.gguf_file import GGUFFile
    meta = GGUFFile(path).metadata
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise NotImplementedError(f"{path}: GGUF tokenizer model {kind!r} is not supported; only byte-level "
                                  "BPE ('gpt2') is. Point --tokenizer at the model's HF tokenizer directory.")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens")
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges: list[str] = meta.get("tokenizer.ggml.merges")
    assert len(token_types) == len(tokens), "token_type must give one type per token"
    # A file without a pre-tokenizer name predates them; llama.cpp then splits as GPT-2 does.
    backend = _byte_level_bpe(tokens, token_types, merges, meta.get("tokenizer.ggml.pre") or "gpt-2")

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None else None

    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=token("bos_token_id"), eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"), pad_token=token("padding_token_id"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token")),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token")),
        chat_template=meta.get("tokenizer.chat_template"), clean_up_tokenization_spaces=False)
    eos = {meta.get(f"tokenizer.ggml.{key}") for key in ("eos_token_id", "eot_token_id", "eom_token_id")}
    return Tokenizer(hf, frozenset(i for i in eos if i is not None))


def _byte_level_bpe(tokens: list[str], token_types: list[int], merges: list[str], pre: str) -> RustTokenizer:
    to_byte_char = _bytes_to_unicode()
    byte_chars = set(to_byte_char.values())

    def spelled(t: str) -> bool:
        return set(t) <= byte_chars

    # llama.cpp stores some tokens as raw text; the BPE model needs them in the byte alphabet.
    vocab = {t if spelled(t) else "".join(to_byte_char[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    backend = RustTokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges],
                                       fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    # Control and user-defined tokens match whole in the text. Those spelled outside the byte
    # alphabet would get fresh ids past the vocabulary, so (as transformers does) they are left
    # to the merges.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, token_types) if kind == _CONTROL and spelled(t)])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED and spelled(t)])
    assert backend.get_vocab_size(with_added_tokens=True) == len(tokens), "added tokens must reuse vocab ids"
    return backend


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in _GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    for names, split in ((_LLAMA3, _LLAMA3_SPLIT), (_QWEN2, _QWEN2_SPLIT)):
        if pre in names:
            bytes_only = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
            return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"), bytes_only])
    known = sorted(_DIGITS_THEN_GPT2 + _GPT2 + _LLAMA3 + _QWEN2)
    raise NotImplementedError(f"GGUF pre-tokenizer {pre!r} is not supported; known: {known}")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the rest map above U+0100."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}
