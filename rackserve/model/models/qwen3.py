"""Qwen3 (dense): Llama with an RMSNorm over each q and k head before RoPE, and head_dim taken
from the config rather than hidden_size / num_heads.

This file must never duplicate Llama's layers; it only states how Qwen3 differs.
"""
from __future__ import annotations

from typing import Any

import torch

from rackserve.distributed.parallel_state import GroupCoordinator, ParallelGroups
from rackserve.model.layers import RMSNorm
from rackserve.model.models.llama import LlamaAttention, LlamaForCausalLM
from rackserve.model.rotary import apply_rope


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: dict[str, Any], attn_backend: str, tp: GroupCoordinator):
        super().__init__(config, attn_backend, tp)
        eps = config.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)

    def rotate_qk(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = qkv.shape[0]
        q = self.q_norm(qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim))
        k = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention

    def __init__(self, config: dict[str, Any], attn_backend: str, max_position: int, groups: ParallelGroups):
        assert not config.get("use_sliding_window", False), "Qwen3 sliding-window attention is not supported"
        super().__init__(config, attn_backend, max_position, groups)
