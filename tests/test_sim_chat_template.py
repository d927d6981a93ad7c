"""A simulated prompt is as long as the served one: its words inside the model's chat template
tokens, measured from the tokenizer the server uses (checked against that tokenizer's own
rendering of conversations the probes never saw)."""
from __future__ import annotations

from rackserve.bench.token_text import load_server_tokenizer, vocabulary_from_tokenizer
from rackserve.sim.chat_template import TemplateTokens, measure, template_for
from rackserve.sim.cluster import Tokens


def test_simulated_prompts_carry_the_chat_templates_tokens():
    tokenizer = load_server_tokenizer("smollm2-135m-instruct")
    words = vocabulary_from_tokenizer(tokenizer, "smollm2", 300).words
    template = measure("smollm2-135m-instruct")
    assert template.default_system > 0 and template.per_message > 0
    tokens = Tokens(tokenizer.hf.vocab_size, template)
    for roles, length in ((("user",), 70), (("system", "user"), 150), (("system", "user", "assistant", "user"), 33)):
        messages = [{"role": r, "content": " ".join(words[i * length:(i + 1) * length])} for i, r in enumerate(roles)]
        # Within a token a message: a message's first word, right after the role marker, has no
        # space before it, and the tokenizer may split it where the simulator counts one word.
        assert abs(len(tokens.encode(messages)) - len(tokenizer.apply_chat_template(messages))) <= len(roles)
    # Equal template parts are equal tokens: two prompts share their system prefix.
    a = tokens.encode([{"role": "user", "content": "one two"}])
    b = tokens.encode([{"role": "user", "content": "three"}])
    assert a[:template.default_system + template.per_message] == b[:template.default_system + template.per_message]
    assert template_for("llama-3-8b") == template_for("none") == TemplateTokens()   # config-only alias: none
