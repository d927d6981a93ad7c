"""Building blocks shared by the decoder models: norms, linears, embedding, lm_head, activation.

Each weight-bearing layer is a small class whose parameters carry a `weight_loader(param, loaded,
shard_id)`, so that checkpoints written with separate q/k/v or gate/up tensors load into our fused
layers, and so that tensor parallelism is a local change (a parallel layer slices in its loader
and reduces in its forward). This file must never know about the KV cache, attention metadata or
any particular architecture.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _param(*shape: int) -> nn.Parameter:
    # Uninitialised on purpose: every parameter is overwritten by the checkpoint, and random
    # initialisation of a large model would cost seconds.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    assert param.shape == loaded.shape, f"shape mismatch: param {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}"
    param.data.copy_(loaded)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = _param(hidden_size)
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Linear(nn.Module):
    """y = x W^T (+ b), W of shape [output_size, input_size], loaded whole."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = _param(output_size, input_size)
        self.weight.weight_loader = self.weight_loader
        self.bias = _param(output_size) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        assert shard_id is None, f"{type(self).__name__} takes no shards"
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several linears of one input concatenated along the output (gate_proj + up_proj): one GEMM
    instead of several. Shard i of the checkpoint fills rows [sum(sizes[:i]), sum(sizes[:i+1]))."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        self.shard_offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        assert isinstance(shard_id, int), "MergedLinear loads one shard at a time"
        start, size = self.shard_offsets[shard_id], self.output_sizes[shard_id]
        assert loaded.shape[0] == size, f"shard {shard_id}: {loaded.shape[0]} rows, expected {size}"
        default_weight_loader(param.data.narrow(0, start, size), loaded)


class QKVLinear(MergedLinear):
    """q_proj, k_proj and v_proj fused; shards are named "q", "k", "v"."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias)
        self.q_size, self.kv_size = q_size, kv_size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        assert shard_id in ("q", "k", "v"), f"QKVLinear shard must be q, k or v, got {shard_id!r}"
        super().weight_loader(param, loaded, "qkv".index(shard_id))


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = _param(vocab_size, hidden_size)
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Hidden states to logits; shares the embedding's weight when the checkpoint ties them."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_embedding: VocabEmbedding | None = None):
        super().__init__()
        if tied_embedding is not None:
            self.weight = tied_embedding.weight
        else:
            self.weight = _param(vocab_size, hidden_size)
            self.weight.weight_loader = default_weight_loader

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
