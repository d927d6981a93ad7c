"""Small real tokenizers for tests: a byte-level BPE trained on the spot with ChatML special
tokens, saved as an HF tokenizer directory, so tiny random models get a tokenizer of their own.

This file owns test fixtures only; it must never download anything or mock a tokenizer.
"""
from __future__ import annotations

import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Enough distinct words, digits, code and a little unicode for a few hundred merges.
_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A serving engine schedules requests, batches
tokens and streams text back to the user while the model computes the next token.
def add(a, b):
    return a + b
for i in range(10):
    print(i * 2, "hello world")
Prices: 12.50, 3.14159, 2024-06-01, 100%, $42 and 7 apples.
Caches keep the keys and values of earlier tokens; a prefix hit skips work already done.
Über café naïve résumé — “quotes” and ‘single’ ones… 日本語のテキスト, 中文文本, 한국어, emoji 🙂🚀.
Paged attention splits the cache into blocks; the scheduler allocates blocks as sequences grow.
"""


def train_test_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE with ids < vocab_size; ids 0-2 are <|endoftext|>, <|im_start|>, <|im_end|>."""
    assert vocab_size >= 256 + len(SPECIAL_TOKENS), "a byte-level vocabulary needs all 256 bytes"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_TRAINING_TEXT.splitlines(keepends=True) * 4, trainer=trainer)
    assert tok.get_vocab_size() <= vocab_size
    return tok


def save_test_tokenizer(path: str, vocab_size: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into directory `path`;
    EOS is <|im_end|>, as in ChatML models."""
    from transformers import PreTrainedTokenizerFast
    os.makedirs(path, exist_ok=True)
    hf = PreTrainedTokenizerFast(tokenizer_object=train_test_tokenizer(vocab_size), eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>", unk_token="<|endoftext|>",
                                 additional_special_tokens=["<|im_start|>"], chat_template=CHATML_TEMPLATE)
    hf.save_pretrained(path)


def save_test_gguf_tokenizer(path: str, vocab_size: int, pre: str) -> None:
    """Write a GGUF file at `path` holding only tokenizer metadata (llama.cpp's keys) for the
    same trained BPE plus two user-defined tokens, "<think>" and "<tool call>" (raw text, as
    llama.cpp stores them), with pre-tokenizer name `pre`, BOS added, EOS <|im_end|>."""
    import gguf
    user_defined = ["<think>", "<tool call>"]
    tok = train_test_tokenizer(vocab_size - len(user_defined))
    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].__getitem__)
    assert [model["vocab"][t] for t in tokens] == list(range(len(tokens))), "ids must be dense"
    types = [gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens]
    tokens += user_defined
    types += [gguf.TokenType.USER_DEFINED] * len(user_defined)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in model["merges"]])
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHATML_TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def train_test_metaspace_tokenizer(vocab_size: int):
    """A SentencePiece-style BPE ("▁" marks a word start; decoding drops the text's leading
    space) wrapped as a PreTrainedTokenizerFast with EOS </s>."""
    from tokenizers import SentencePieceBPETokenizer
    from transformers import PreTrainedTokenizerFast
    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(_TRAINING_TEXT.splitlines() * 4, vocab_size=vocab_size,
                           special_tokens=["<unk>", "</s>"], show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=sp._tokenizer, eos_token="</s>", unk_token="<unk>")
