"""Qwen2: Llama with a bias on q/k/v (always, whatever the config says) and none on o_proj.

This file must never duplicate Llama's layers; it only states how Qwen2 differs.
"""
from __future__ import annotations

from typing import Any

from rackserve.distributed.parallel_state import ParallelGroups
from rackserve.model.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    @staticmethod
    def qkv_bias(config: dict[str, Any]) -> bool:
        return True

    @staticmethod
    def o_bias(config: dict[str, Any]) -> bool:
        return False


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention

    def __init__(self, config: dict[str, Any], attn_backend: str, max_position: int, groups: ParallelGroups):
        assert not config.get("use_sliding_window", False), "Qwen2 sliding-window attention is not supported"
        super().__init__(config, attn_backend, max_position, groups)
