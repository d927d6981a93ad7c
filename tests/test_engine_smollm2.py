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


_HF_CACHE: dict[tuple[int, ...], tuple[list[int], list[set[int]]]] = {}


def hf_greedy_with_top5(model, prompt: list[int]) -> tuple[list[int], list[set[int]]]:
    """Memoised: both parametrizations ask for the same prompts."""
    if tuple(prompt) not in _HF_CACHE:
        _HF_CACHE[tuple(prompt)] = _hf_greedy_with_top5(model, prompt)
    return _HF_CACHE[tuple(prompt)]


def _hf_greedy_with_top5(model, prompt: list[int]) -> tuple[list[int], list[set[int]]]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        # An explicit mask: SmolLM2's pad id is <|im_end|>, which chat prompts contain, and
        # generate() would otherwise mask those tokens out of the prompt.
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NUM_TOKENS,
                             eos_token_id=None, output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [set(s[0].topk(5).indices.tolist()) for s in out.scores]


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
        ref, ref_top5 = hf_greedy_with_top5(smollm2_hf, out.prompt_token_ids)
        assert len(ours) == NUM_TOKENS
        diverged = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        if diverged is None:
            identical += 1
            continue
        our_top5 = set(out.outputs[0].logprobs[diverged])   # the sampled token and the top 5
        assert ref[diverged] in our_top5 and ours[diverged] in ref_top5[diverged], \
            f"{out.prompt!r}: diverged at token {diverged} outside each other's top-5"
    assert identical >= min_identical, f"only {identical} of {len(CHATS)} chats identical over {NUM_TOKENS} tokens"
