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

# The KV cache for engines and servers of these models, GiB, where its size pins nothing: the
# default 2 GiB is 100k-2.5M blocks of a tiny model, whose bookkeeping (built at start, walked by
# every check_integrity) cost seconds an engine; 16 MiB still holds thousands of blocks.
TINY_KV_CACHE_GIB = 1 / 64

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


# DeepSeek-V4: every attention kind (sliding window 16; CSA at ratio 4 with a 4-head indexer that
# keeps the top 4 entries; HCA at ratio 16, so short prompts close groups), hash-routed and routed
# MoE layers (8 experts, top-2, a shared expert), mHC with 4 streams, YaRN on the compressed layers
# over an original context of 64, grouped output projection in 2 groups.
DEEPSEEK_V4: dict[str, Any] = dict(
    hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
    q_lora_rank=48, partial_rotary_factor=0.25, vocab_size=512, n_routed_experts=8, num_experts_per_tok=2,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    sliding_window=16, o_groups=2, o_lora_rank=16, index_n_heads=4, index_head_dim=16, index_topk=4, hc_mult=4,
    max_position_embeddings=1024, initializer_range=0.15, rms_norm_eps=1e-6, swiglu_limit=1.0,
    rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1},
    bos_token_id=1, eos_token_id=2, pad_token_id=0)


def build_tiny_deepseek_v4(path: str | os.PathLike, seed: int = 0, **config_overrides: Any) -> str:
    """A random DeepseekV4ForCausalLM (DEEPSEEK_V4 + overrides) saved as safetensors in `path`.
    What transformers initialises to constants (sinks, slot biases, mHC biases and scales, norms,
    the correction bias, the hash table) is drawn at random too, so that none of it can be
    loaded wrongly unnoticed; each token's hash experts are distinct."""
    import transformers
    config = transformers.DeepseekV4Config(**{**DEEPSEEK_V4, **config_overrides})
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("hc.scale", "hc_scale")):
                p.normal_(1.0, 0.2)
            elif name.endswith(("sinks", "position_bias", "hc.base", "hc_base")):
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
            elif name.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(config.n_routed_experts)[:config.num_experts_per_tok]
                                     for _ in range(config.vocab_size)]))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def identical_or_within_top(a_outs: list, b_outs: list) -> int:
    """vLLM's rule for two greedy runs of different precision (RequestOutputs with logprobs): at
    the first token where a request's runs differ, each side's token is among the other's top
    logprobs there. Asserts it for every request; returns how many requests did not differ."""
    identical = 0
    for a, b in zip(a_outs, b_outs, strict=True):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        diverged = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        if diverged is None:
            identical += 1
            continue
        assert ta[diverged] in b.outputs[0].logprobs[diverged] and tb[diverged] in a.outputs[0].logprobs[diverged]
    return identical
