"""Llama (and SmolLM2): the dense decoder the other dense architectures specialise.

The CausalLM interface every registered model offers the runner:
  `Model(config: dict, attn_backend: str, max_position: int, groups: ParallelGroups)`,
  `forward(input_ids [T], positions [T], attn_metadata) -> hidden [T, hidden_size]`,
  `compute_logits(hidden [R, hidden_size]) -> logits [R, vocab_size]`,
  `load_weights(iterable of (HF tensor name, tensor))`.
q/k/v and gate/up are fused at load time; the residual add is carried into the next norm as in
vLLM so that each layer does two adds. DecoderLayer and DecoderModel serve the MoE models too
(moe_decoder.py). Under tensor parallelism (groups.tp) attention heads and
the MLP's intermediate features are split across ranks (column-parallel qkv and gate_up,
row-parallel o_proj and down_proj), as are the embedding's and lm_head's vocabulary. This file
must never build attention metadata or touch the KV cache other than through its Attention layers.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from rackserve.distributed.parallel_state import GroupCoordinator, ParallelGroups
from rackserve.model import native_ops
from rackserve.model.attention import Attention
from rackserve.model.layers import (LMHead, MergedLinear, QKVLinear, RMSNorm, RowParallelLinear, VocabEmbedding,
                                    silu_and_mul)
from rackserve.model.models.weights import WeightTracker, stacked_shards, stacked_target
from rackserve.model.rotary import RotaryEmbedding, apply_rope, rope_parameters


def head_dim_of(config: dict[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


class LlamaMLP(nn.Module):
    def __init__(self, config: dict[str, Any], tp: GroupCoordinator):
        super().__init__()
        assert config.get("hidden_act", "silu") == "silu", f"unsupported activation {config.get('hidden_act')}"
        hidden, inter, bias = config["hidden_size"], config["intermediate_size"], config.get("mlp_bias", False)
        self.gate_up_proj = MergedLinear(hidden, [inter, inter], bias, tp)
        self.down_proj = RowParallelLinear(inter, hidden, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    """num_heads, num_kv_heads, q_size and kv_size are this rank's share."""

    def __init__(self, config: dict[str, Any], attn_backend: str, tp: GroupCoordinator):
        super().__init__()
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVLinear(hidden, self.head_dim, heads, config.get("num_key_value_heads") or heads,
                                  self.qkv_bias(config), tp)
        qkv = self.qkv_proj
        self.num_heads, self.num_kv_heads = qkv.num_heads, qkv.num_kv_heads
        self.q_size, self.kv_size = qkv.q_size, qkv.kv_size
        self.o_proj = RowParallelLinear(heads * self.head_dim, hidden, self.o_bias(config), tp,
                                        input_held=(qkv.partition.q_start * self.head_dim, self.q_size))
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5, attn_backend)

    @staticmethod
    def qkv_bias(config: dict[str, Any]) -> bool:
        return bool(config.get("attention_bias", False))

    @staticmethod
    def o_bias(config: dict[str, Any]) -> bool:
        return bool(config.get("attention_bias", False))

    def rotate_qk(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q and k are adjacent in the fused output: one rope over both heads at once, in place in
        # qkv (the projection's own output) where the native op runs.
        heads, t = self.num_heads + self.num_kv_heads, qkv.shape[0]
        if native_ops.rope_neox_(qkv, heads, self.head_dim, cos, sin):
            qk = qkv[:, :self.q_size + self.kv_size].unflatten(1, (heads, self.head_dim))
        else:
            qk = apply_rope(qkv[:, :self.q_size + self.kv_size].view(t, heads, self.head_dim), cos, sin)
        return qk[:, :self.num_heads], qk[:, self.num_heads:]

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k (rotated) and v of x: what the attention op takes (compiled_layers.py compiles it)."""
        qkv = self.qkv_proj(x)
        q, k = self.rotate_qk(qkv, cos, sin)
        v = qkv[:, self.q_size + self.kv_size:].view(qkv.shape[0], self.num_kv_heads, self.head_dim)
        return q, k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        return self.o_proj(self.attn(*self.project(x, cos, sin), attn_metadata))


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer of any architecture here: its attention and its MLP (dense or
    MoE), each behind an RMSNorm, with the residual carried alongside."""

    def __init__(self, config: dict[str, Any], self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = mlp

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # vLLM's fused residual: each norm also returns (and, natively, updates in place) the sum.
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, cos, sin, attn_metadata), residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers, final norm and RoPE: the model body of every architecture here."""

    def __init__(self, config: dict[str, Any], layers: list[nn.Module], rope_dim: int, max_position: int,
                 tp: GroupCoordinator):
        super().__init__()
        hidden = config["hidden_size"]
        self.embed_tokens = VocabEmbedding(config["vocab_size"], hidden, tp)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden, config.get("rms_norm_eps", 1e-6))
        self.rotary_emb = RotaryEmbedding(rope_dim, max_position, rope_parameters(config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions)
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin, attn_metadata)
        return self.norm(h, residual)[0]


class LlamaForCausalLM(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention
    # checkpoint name part -> (our fused parameter's name part, shard id)
    stacked_params = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: dict[str, Any], attn_backend: str, max_position: int, groups: ParallelGroups):
        super().__init__()
        self.config = config
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
        tp = groups.tp
        layers = [DecoderLayer(config, self.attention_cls(config, attn_backend, tp), LlamaMLP(config, tp))
                  for _ in range(config["num_hidden_layers"])]
        self.model = DecoderModel(config, layers, head_dim_of(config), max_position, tp)
        self.lm_head = LMHead(config["vocab_size"], config["hidden_size"],
                              self.model.embed_tokens if self.tie_word_embeddings else None, groups.tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; raises on an unknown name or a parameter left unloaded."""
        tracker = WeightTracker(self)
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            target, shard = stacked_target(name, self.stacked_params)
            tracker.load(target, tensor, shard)
        for name in tracker.params:
            tracker.check(name, stacked_shards(name, self.stacked_params))
