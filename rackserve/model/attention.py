"""Paged attention interface: the step's batch description (CommonAttentionMetadata), the
AttentionBackend base class with its registry by name, and the Attention layer the models hold.

The runner builds CommonAttentionMetadata once per step, asks the backend to turn it into its own
metadata (once per step, not per layer), and passes that explicitly to `model.forward`. The KV
cache is allocated by the runner and bound to the Attention layers with `bind_kv_cache`. This file
must never hold per-step state in globals.
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class CommonAttentionMetadata:
    """One step's flattened batch, independent of any backend: request i owns tokens
    [query_start[i], query_start[i] + query_lens[i]) of the batch, at positions
    context_lens[i] onwards; its KV lives in the blocks of block_tables[i]."""
    query_lens: list[int]
    context_lens: list[int]           # tokens already in the KV cache before this step
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor        # [num_tokens] int64: block_id * block_size + offset
    block_size: int

    def __post_init__(self) -> None:
        assert len(self.query_lens) == len(self.context_lens) == len(self.block_tables)
        assert self.slot_mapping.shape[0] == sum(self.query_lens)


class AttentionBackend(ABC):
    """Computes attention over a paged KV cache for one layer.

    `forward` first writes the new tokens' K/V into the cache at the slot mapping (a side
    effect on kv_cache), then attends each query to its request's cached context plus the new
    tokens of its own request, causally.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's K (and of its V) cache."""
        return (num_blocks, block_size, num_kv_heads, head_dim)

    @staticmethod
    @abstractmethod
    def build_metadata(common: CommonAttentionMetadata, device: torch.device) -> Any:
        """The backend's own per-step metadata; called once per step."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: Any) -> torch.Tensor:
        """q: [T, num_heads, head_dim], k and v: [T, num_kv_heads, head_dim].
        Returns [T, num_heads * head_dim]."""


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_attn_backend(name: str):
    def wrap(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        ATTENTION_BACKENDS[name] = cls
        return cls
    return wrap


def get_attn_backend(name: str) -> type[AttentionBackend]:
    if name not in ATTENTION_BACKENDS:
        # Backend "x" lives in rackserve/model/x_attention.py; importing it registers it.
        try:
            importlib.import_module(f"rackserve.model.{name}_attention")
        except ModuleNotFoundError:
            pass
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(ATTENTION_BACKENDS)}")
    return ATTENTION_BACKENDS[name]


class Attention(nn.Module):
    """The attention op inside a model layer: holds the backend and this layer's KV cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, backend: str):
        super().__init__()
        self.impl = get_attn_backend(backend)(num_heads, num_kv_heads, head_dim, scale)
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        assert self.kv_cache is not None, "no KV cache bound: call bind_kv_cache() first"
        return self.impl.forward(q, k, v, self.kv_cache, attn_metadata)


def attention_layers(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def bind_kv_cache(model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Give each Attention layer, in model order, its (K, V) cache."""
    layers = attention_layers(model)
    assert len(layers) == len(kv_caches), f"{len(layers)} attention layers, {len(kv_caches)} caches"
    for layer, cache in zip(layers, kv_caches):
        layer.kv_cache = cache
