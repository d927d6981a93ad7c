"""Multi-head latent attention (MLA, DeepSeek-V2/V3) as an attention op: the MLABackend base class
and the MLAAttention layer a model holds.

Per token and layer the cache holds only the latent: the normalised compressed KV (kv_lora_rank
values) and the roped key shared by all heads (qk_rope_head_dim values), one KVCacheSpec "head"
of their sum, paged like any cache. Keys and values per head are kv_b_proj(latent); the backend
decides whether to expand them or to absorb kv_b_proj into the query and the output. The model
computes the projections and RoPE; this op writes the cache and attends. Under tensor parallelism
num_heads and kv_b_proj's rows are this rank's heads only, while the cache holds the whole latent
on every rank: the latent is per token, not per head, so it cannot be split by heads. This file
must never allocate the cache or hold projections other than a reference to kv_b_proj.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

from rackserve.model.attention import AttentionLayerBase, CommonAttentionMetadata, KVCacheSpec, get_attn_backend


class MLABackend(ABC):
    """Latent attention over a paged cache of [kv_c_normed | k_pe] entries.

    `forward` first writes the new tokens' entries at the slot mapping (a side effect on the
    cache), then attends each query to its request's cached context plus its own new tokens,
    causally, with keys [k_nope | k_pe] and values from kv_b_proj of the latent."""

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, scale: float, kv_b_proj: nn.Module):
        self.num_heads, self.kv_lora_rank, self.scale = num_heads, kv_lora_rank, scale
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        # Held, not registered: the model owns (and loads) kv_b_proj, its weight
        # [num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank] (this rank's heads) is read
        # at each forward.
        self.kv_b_proj = kv_b_proj

    @staticmethod
    @abstractmethod
    def build_metadata(common: CommonAttentionMetadata, device: torch.device) -> Any:
        """The backend's own per-step metadata; called once per step."""

    @abstractmethod
    def forward(self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                kv_cache: tuple[torch.Tensor, ...], metadata: Any) -> torch.Tensor:
        """q: [T, num_heads, qk_nope_head_dim + qk_rope_head_dim] (roped); kv_c_normed:
        [T, kv_lora_rank]; k_pe: [T, qk_rope_head_dim] (roped). Returns [T, num_heads * v_head_dim]."""


class MLAAttention(AttentionLayerBase):
    """The MLA op inside a model layer: holds the backend ("name_mla") and this layer's latent cache."""

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, scale: float, kv_b_proj: nn.Module, backend: str):
        super().__init__()
        self.impl = get_attn_backend(backend, use_mla=True)(num_heads, kv_lora_rank, qk_nope_head_dim,
                                                            qk_rope_head_dim, v_head_dim, scale, kv_b_proj)
        self.kv_cache_spec = KVCacheSpec(1, kv_lora_rank + qk_rope_head_dim, use_mla=True)

    def forward(self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                attn_metadata: Any) -> torch.Tensor:
        assert self.kv_cache is not None, "no KV cache bound: call bind_kv_cache() first"
        return self.impl.forward(q, kv_c_normed, k_pe, self.kv_cache, attn_metadata)
