"""Tiny random HF checkpoints built with transformers, the reference implementation for parity.

Sizes are tiny so a test runs in seconds; weights are drawn with a large initializer_range and a
fixed seed so greedy logits are far from ties and every run builds the same model. This file must
never download anything.
"""
from __future__ import annotations

import os
from typing import Any

import torch

TINY_DEFAULTS: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=512, max_position_embeddings=1024, initializer_range=0.15, rms_norm_eps=1e-6,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)

# Llama 3.1 rope scaling with an original context of 64, so the scaling acts on short prompts.
LLAMA3_ROPE: dict[str, Any] = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def build_tiny_model(arch: str, path: str | os.PathLike, seed: int = 0, **config_overrides: Any) -> str:
    """Save a random `arch` model (e.g. "LlamaForCausalLM") as safetensors + config.json in `path`."""
    import transformers
    assert arch in ARCHITECTURES, f"unknown tiny architecture {arch!r}"
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = config_cls(**{**TINY_DEFAULTS, **config_overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        # transformers initialises biases to 0 and norm weights to 1, which would let a bias or
        # norm that is loaded into the wrong place (or not at all) go unnoticed.
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, config.initializer_range)
            elif "norm" in name:
                param.normal_(1.0, 0.2)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def load_hf(path: str | os.PathLike, **kwargs: Any):
    """The transformers reference model of a tiny checkpoint, float32, eager attention."""
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", **kwargs).eval()
