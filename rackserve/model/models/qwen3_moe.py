"""Qwen3-MoE: Qwen3's attention (q/k norms) with a sparse MoE block in place of the MLP: softmax
top-k routing (weights renormalised over the chosen experts when norm_topk_prob), no shared
expert. Layers listed in mlp_only_layers, or off the decoder_sparse_step stride, keep a dense MLP.
Tensor and expert parallelism split attention as Qwen3's and the experts as FusedMoE does.

This file must never duplicate Qwen3's or the shared skeleton's layers; it only states how
Qwen3-MoE differs.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rackserve.distributed.parallel_state import ParallelGroups
from rackserve.model.models.llama import DecoderLayer, LlamaMLP, head_dim_of
from rackserve.model.models.moe_decoder import MoECausalLM
from rackserve.model.models.qwen3 import Qwen3Attention
from rackserve.model.moe import FusedMoE
from rackserve.model.gate import MoEGate, RoutingConfig


def num_experts_of(config: dict[str, Any]) -> int:
    # Checkpoints say num_experts; transformers 5 saves its alias num_local_experts.
    return config.get("num_experts") or config.get("num_local_experts") or 0


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, config: dict[str, Any], groups: ParallelGroups):
        super().__init__()
        assert config.get("hidden_act", "silu") == "silu", f"unsupported activation {config.get('hidden_act')}"
        num_experts = num_experts_of(config)
        routing = RoutingConfig(num_experts, config["num_experts_per_tok"], "softmax",
                                bool(config.get("norm_topk_prob", False)))
        self.gate = MoEGate(config["hidden_size"], routing)
        self.experts = FusedMoE(num_experts, config["hidden_size"], config["moe_intermediate_size"], groups=groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


class Qwen3MoeForCausalLM(MoECausalLM):
    def __init__(self, config: dict[str, Any], attn_backend: str, max_position: int, groups: ParallelGroups):
        assert not config.get("use_sliding_window", False), "Qwen3-MoE sliding-window attention is not supported"
        super().__init__(config, attn_backend, max_position, groups)

    def make_layer(self, config: dict[str, Any], layer_idx: int, attn_backend: str,
                   groups: ParallelGroups) -> nn.Module:
        sparse = (layer_idx not in (config.get("mlp_only_layers") or []) and num_experts_of(config) > 0
                  and (layer_idx + 1) % config.get("decoder_sparse_step", 1) == 0)
        mlp = Qwen3MoeSparseMoeBlock(config, groups) if sparse else LlamaMLP(config, groups.tp)
        return DecoderLayer(config, Qwen3Attention(config, attn_backend, groups.tp), mlp)

    @staticmethod
    def rope_dim(config: dict[str, Any]) -> int:
        return head_dim_of(config)
