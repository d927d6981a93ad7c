"""Paged attention interface: the step's batch description (CommonAttentionMetadata), what one
layer caches per token (KVCacheSpec), the AttentionBackend base class with its registry by name,
and the Attention layer the models hold.

The runner builds CommonAttentionMetadata once per step, asks the backend to turn it into its own
metadata (once per step, not per layer), and passes that explicitly to `model.forward`. The KV
cache is allocated by the runner from the layers' KVCacheSpec and bound to them with
`bind_kv_cache`. Layers of one kind share a backend: "name" for MHA/GQA (Attention), "name_mla"
for multi-head latent attention (MLAAttention, model/mla.py). This file must never hold per-step
state in globals.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rackserve.registry import Registry


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
    workspace: Workspace | None = None   # the runner's scratch memory; None: fresh tensors
    # A model with several KV cache groups (core/kv_cache_groups.py): every group's table per
    # request (block_tables and slot_mapping are the first group's), and per request the leading
    # blocks of each group that came from the prefix cache and must not be written.
    group_block_tables: list[tuple[list[int], ...]] | None = None
    num_hit_blocks: list[tuple[int, ...]] | None = None

    def __post_init__(self) -> None:
        assert len(self.query_lens) == len(self.context_lens) == len(self.block_tables)
        assert self.slot_mapping.shape[0] == sum(self.query_lens)


class Workspace:
    """Scratch tensors that live across layers and steps (one runner's), one per name, grown on
    demand: the torch backends gather a step's paged context into them. A fresh CPU tensor of
    more than 32 MiB is a fresh mmap under glibc, whose first-touch page faults cost several
    times the copy (32 decodes over 2K tokens of SmolLM2: 29 ms a layer into new tensors, 3.8 ms
    into reused ones). What a layer takes is dead before the next layer takes the same name."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(shape)
        key = (name, dtype, device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            # A quarter of headroom: contexts grow a block at a time, the buffer far less often.
            buffer = self._buffers[key] = torch.empty(numel + numel // 4, dtype=dtype, device=device)
        return buffer[:numel].view(shape)

    def gather_blocks(self, name: str, cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """cache[block_ids] (cache: [num_blocks, ...]), into this workspace's buffer `name`."""
        out = self.take(name, (block_ids.shape[0], *cache.shape[1:]), cache.dtype, cache.device)
        return torch.index_select(cache, 0, block_ids, out=out)


# The 8-bit float KV cache dtypes (--kv-cache-dtype fp8 / fp8_e5m2).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def write_cache(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """cache[slots] = values along dim 0, rounded to the cache's dtype. An 8-bit float cache saturates
    at its largest finite value (as vLLM's fp8 cache does; torch's cast to e5m2 would give inf) and
    is written through byte views: torch 2.13 has no index_copy_ for float8 on CPU."""
    if cache.dtype in FP8_DTYPES:
        limit = torch.finfo(cache.dtype).max
        cache.view(torch.uint8).index_copy_(0, slots, values.clamp(-limit, limit).to(cache.dtype).view(torch.uint8))
    else:
        cache.index_copy_(0, slots, values.to(cache.dtype))


@dataclass(frozen=True)
class KVCacheSpec:
    """What one attention layer caches: `num_tensors` tensors, each [num_blocks, block_size,
    num_kv_heads, head_size]. MHA/GQA caches K and V (2 tensors) of this rank's KV heads; MLA
    caches one latent per token (1 tensor, one "head" of kv_lora_rank + qk_rope_head_dim values)
    that all query heads share. A `family` ("dsv4") names layers whose backend is "name_family"
    and who cache one tensor of `head_size` values per token, laid out by the family itself."""
    num_kv_heads: int
    head_size: int
    use_mla: bool = False
    family: str = ""

    @property
    def num_tensors(self) -> int:
        return 1 if self.use_mla or self.family else 2

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.num_tensors * self.num_kv_heads * self.head_size * dtype.itemsize

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one of the layer's `num_tensors` cache tensors."""
        return (num_blocks, block_size, self.num_kv_heads, self.head_size)


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
    @abstractmethod
    def build_metadata(common: CommonAttentionMetadata, device: torch.device) -> Any:
        """The backend's own per-step metadata; called once per step."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: Any) -> torch.Tensor:
        """q: [T, num_heads, head_dim], k and v: [T, num_kv_heads, head_dim].
        Returns [T, num_heads * head_dim]."""


# name -> AttentionBackend subclass; names ending in "_mla" -> MLABackend subclass (model/mla.py).
# Backend "x" lives in rackserve/model/x_attention.py; importing it registers it.
ATTENTION_BACKENDS: Registry[Any] = Registry("attention backend", "rackserve.model.{}_attention")
register_attn_backend = ATTENTION_BACKENDS.register


def get_attn_backend(name: str, use_mla: bool = False, family: str = "") -> Any:
    """Backend `name` (an AttentionBackend); with use_mla, its latent-attention sibling
    `name_mla` (an MLABackend); with a family, `name_family`. All build their per-step metadata
    with `build_metadata`."""
    return ATTENTION_BACKENDS.get(f"{name}_mla" if use_mla else f"{name}_{family}" if family else name)


class AttentionLayerBase(nn.Module):
    """A layer that owns one layer's paged KV cache (vLLM's name): Attention or MLAAttention."""

    kv_cache_spec: KVCacheSpec
    kv_cache: tuple[torch.Tensor, ...] | None = None


class Attention(AttentionLayerBase):
    """The attention op inside a model layer: holds the backend and this layer's K and V cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, backend: str):
        super().__init__()
        self.impl = get_attn_backend(backend)(num_heads, num_kv_heads, head_dim, scale)
        self.kv_cache_spec = KVCacheSpec(num_kv_heads, head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        assert self.kv_cache is not None, "no KV cache bound: call bind_kv_cache() first"
        return self.impl.forward(q, k, v, self.kv_cache, attn_metadata)


def attention_layers(model: nn.Module) -> list[AttentionLayerBase]:
    return [m for m in model.modules() if isinstance(m, AttentionLayerBase)]


def model_kv_cache_spec(model: nn.Module) -> KVCacheSpec:
    """The one spec all of the model's attention layers share (this rank's, under TP)."""
    specs = {layer.kv_cache_spec for layer in attention_layers(model)}
    assert len(specs) == 1, f"attention layers with different KV cache specs are not supported: {specs}"
    return specs.pop()


def bind_kv_cache(model: nn.Module, kv_caches: list[tuple[torch.Tensor, ...]]) -> None:
    """Give each attention layer, in model order, its cache: (K, V), or (latent,) for MLA."""
    layers = attention_layers(model)
    assert len(layers) == len(kv_caches), f"{len(layers)} attention layers, {len(kv_caches)} caches"
    for layer, cache in zip(layers, kv_caches):
        spec = layer.kv_cache_spec
        fits = len(cache) == spec.num_tensors and all(t.shape[2:] == (spec.num_kv_heads, spec.head_size) for t in cache)
        assert fits, f"cache of shapes {[tuple(t.shape) for t in cache]} does not fit {spec}"
        layer.kv_cache = cache
