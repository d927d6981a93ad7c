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

# MoE configs: 8 experts, top-2. Qwen3-MoE with a dense layer in the middle (mlp_only_layers);
# DeepSeek-V3 with MLA (q_lora_rank 48, kv_lora_rank 32, rope 16, nope 32, v 32), a dense first
# layer, 2 expert groups of which 1 is used, a shared expert and a routing scale.
QWEN3_MOE: dict[str, Any] = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32,
                                 norm_topk_prob=True, mlp_only_layers=[1])
DEEPSEEK_V3: dict[str, Any] = dict(
    num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
    n_group=2, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
    qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
# DeepSeek-V3's yarn, 256 tokens stretched 4x to the tiny models' 1024; mscale and mscale_all_dim
# differ, so both the cos/sin factor and the softmax scale act.
DEEPSEEK_YARN_ROPE: dict[str, Any] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1,
                                      "mscale": 1.0, "mscale_all_dim": 0.8}

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                 "DeepseekV3ForCausalLM")


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
        # DeepSeek's selection-only bias starts at 0; drawn at the scale of the sigmoid scores'
        # spread, it changes which experts some tokens choose.
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def load_hf(path: str | os.PathLike, **kwargs: Any):
    """The transformers reference model of a tiny checkpoint, float32, eager attention."""
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", **kwargs).eval()
