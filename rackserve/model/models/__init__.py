"""The registry of model architectures, keyed by the HF `architectures` name.

Adding an architecture is a new file here holding a class with the CausalLM interface of
llama.py (forward, compute_logits, load_weights) and one line below. Modules are imported only
when their architecture is asked for. This file must never hold model code.
"""
from __future__ import annotations

import importlib

from torch import nn

# architecture name -> (module under rackserve.model.models, class name)
MODEL_REGISTRY: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "DeepseekV4ForCausalLM": ("deepseek_v4", "DeepseekV4ForCausalLM"),
}


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {sorted(MODEL_REGISTRY)}")
    module, name = MODEL_REGISTRY[architecture]
    return getattr(importlib.import_module(f"rackserve.model.models.{module}"), name)
