"""Greedy chats of SmolLM2 in each --packed-activations mode against transformers' float32 run of the
same GGUF, by the rule tests/test_engine_smollm2.py applies (vLLM's top-5 rule): a chat is identical
over --max-tokens tokens, or it diverges where each side's token is in the other's top 5, or outside.
transformers' own bfloat16 run (the offline peer's numerics, bench throughput's HF) is judged by the
same rule for scale. The prompts carry a long system message so that every prompt chunk is a call of
64+ rows, where the modes differ (vnni_linear.PARTS_MIN_ROWS); the eight chats are batched in one
engine, as an offline run batches them. The modes run over a float32 KV cache; a last engine row
runs the engine's defaults on this machine (--packed-activations and --kv-cache-dtype auto: adaptive
and float16 under the vnni kernel). It serves nothing and times nothing.

    python bench/activation_parts_greedy.py --output bench/results/activation-parts-greedy-smollm2-zen5-s30.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rackserve import LLM, SamplingParams  # noqa: E402
from rackserve.bench.record import machine_state  # noqa: E402
from rackserve.config import smollm2_gguf_path  # noqa: E402
from tests.test_engine_smollm2 import hf_greedy_with_top5  # noqa: E402  (the test's reference rule)

CHATS = ["What is the capital of France?", "Write a haiku about the sea.",
         "List three prime numbers and explain why they are prime.",
         "Translate 'good morning' into Spanish and German.",
         "Explain how a hash table works, with an example in Python, and say when it is a poor choice.",
         "Summarise the causes of the First World War in five bullet points.",
         "Write a short story about a robot who learns to paint, in about a hundred words.",
         "What are the differences between TCP and UDP? Give two uses of each."]
SYSTEM = "You are a helpful assistant. " * 12
# Each mode over a float32 KV cache, then the engine's own auto choices.
MODES = {"two-part": {"packed_activations": "two-part", "kv_cache_dtype": "float32"},
         "adaptive": {"packed_activations": "adaptive", "kv_cache_dtype": "float32"},
         "one-part": {"packed_activations": "one-part", "kv_cache_dtype": "float32"},
         "defaults (auto)": {}}


def judge(f32, prompt: list[int], ours: list[int], our_top5) -> dict:
    """Where `ours` first leaves transformers' float32 greedy choice, and whether each side's token
    there is in the other's top 5 (`our_top5(i)`: our top-5 set at position i)."""
    ref, ref_top5 = hf_greedy_with_top5(f32, prompt, ours)
    at = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    if at is None:
        return {"diverges_at": None, "within_top5": True}
    return {"diverges_at": at, "within_top5": ref[at] in our_top5(at) and ours[at] in ref_top5[at]}


def summary(chats: list[dict]) -> dict:
    return {"identical": sum(c["diverges_at"] is None for c in chats),
            "within_top5": sum(c["diverges_at"] is not None and c["within_top5"] for c in chats),
            "outside_top5": sum(not c["within_top5"] for c in chats),
            "first_divergences": sorted(c["diverges_at"] for c in chats if c["diverges_at"] is not None)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--output")
    args = parser.parse_args()
    path = smollm2_gguf_path()
    load = dict(gguf_file=os.path.basename(path))
    f32 = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), dtype=torch.float32, **load).eval()
    messages = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": c}] for c in CHATS]
    results = {}
    for mode, flags in MODES.items():
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=5)
        with LLM(path, dtype="float32", device="cpu", **flags) as llm:
            outs = llm.chat(messages, params)
            if not flags:
                m, c = llm.engine.config.model, llm.engine.config.cache
                mode = f"defaults ({m.packed_activations}, KV {c.cache_dtype or m.dtype})"
        chats = [judge(f32, o.prompt_token_ids, list(o.outputs[0].token_ids),
                       lambda i, o=o: set(o.outputs[0].logprobs[i])) for o in outs]
        results[mode] = {"chats": chats, **summary(chats)}
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), dtype=torch.bfloat16, **load).eval()
    chats = []
    for prompt in (list(o.prompt_token_ids) for o in outs):     # the engine's prompts, the same for every row
        with torch.inference_mode():
            out = bf16.generate(torch.tensor([prompt]), max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
                                do_sample=False)[0, len(prompt):].tolist()
            logits = bf16(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:].float()
        chats.append(judge(f32, prompt, out, lambda i, lg=logits: set(lg[i].topk(5).indices.tolist())))
    results["transformers bfloat16"] = {"chats": chats, **summary(chats)}
    for name, r in results.items():
        print(f"{name:22s} {r['identical']} of {len(CHATS)} identical over {args.max_tokens} tokens, "
              f"{r['within_top5']} diverge within each other's top 5, {r['outside_top5']} outside; "
              f"first divergences at {r['first_divergences']}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"command": "python " + " ".join(sys.argv), "bench": "activation_parts_greedy",
                       "max_tokens": args.max_tokens, "chats": CHATS, "system": SYSTEM, **machine_state(),
                       "results": results}, f, indent=1)
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
