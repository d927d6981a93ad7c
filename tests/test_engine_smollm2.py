"""SmolLM2-135M-Instruct (the real GGUF) through the whole engine against transformers loading the
same file: 4 chat prompts x 32 greedy tokens, batched together with small prefill chunks.

Greedy tokens must be identical or, where fp32 summation order makes them diverge, each side's
token must be inside the other's top-5 at the first divergence (vLLM's rule); nothing after a
divergence is compared, since the two continue from different text. Run twice: weights
dequantized at load (fp32 throughout, so most chats stay identical), and kept quantized
(--quantization gguf, whose int4 kernel takes bf16 activations, so chats diverge sooner).
"""
from __future__ import annotations

import pytest
import torch

from rackserve import LLM, SamplingParams

NUM_TOKENS = 32
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
    "Translate 'good morning' into Spanish and German.",
]


def hf_greedy_with_top5(model, prompt: list[int], ours: list[int]) -> tuple[list[int], list[set[int]]]:
    """transformers' greedy tokens and top-5 sets over `ours`, up to and including the first token
    where transformers' greedy choice differs from ours, from one forward pass over prompt + ours.
    Up to that token both sequences share their prefix, so each position's argmax is the token
    generate() would pick there (as a full-sequence pass, not a cached one token at a time: another
    fp32 summation order, which the top-5 rule exists for). Nothing after it is compared. One pass
    instead of 32 cached steps: the 4 chats' reference took ~16 s of generate() on a Zen 1."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1:len(prompt) - 1 + len(ours)]
    greedy = logits.argmax(-1).tolist()
    top5 = [set(row) for row in logits.topk(5).indices.tolist()]
    end = next((i + 1 for i, (a, b) in enumerate(zip(ours, greedy)) if a != b), len(ours))
    return greedy[:end], top5[:end]


@pytest.mark.parametrize("quantization,min_identical", [("none", 3), ("gguf", 1)])
def test_smollm2_chat_greedy_matches_transformers(smollm2_gguf, smollm2_hf, quantization, min_identical):
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    with LLM(smollm2_gguf, dtype="float32", device="cpu", max_num_batched_tokens=48,
             quantization=quantization) as llm:
        outs = llm.chat([[{"role": "user", "content": c}] for c in CHATS], params)
        llm.engine.core.scheduler.check_integrity()
    identical = 0
    for out in outs:
        ours = out.outputs[0].token_ids
        assert len(ours) == NUM_TOKENS
        ref, ref_top5 = hf_greedy_with_top5(smollm2_hf, out.prompt_token_ids, list(ours))
        diverged = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        if diverged is None:
            identical += 1
            continue
        our_top5 = set(out.outputs[0].logprobs[diverged])   # the sampled token and the top 5
        assert ref[diverged] in our_top5 and ours[diverged] in ref_top5[diverged], \
            f"{out.prompt!r}: diverged at token {diverged} outside each other's top-5"
    assert identical >= min_identical, f"only {identical} of {len(CHATS)} chats identical over {NUM_TOKENS} tokens"
