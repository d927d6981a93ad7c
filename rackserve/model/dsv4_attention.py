"""DeepSeek-V4 attention as a model layer: the projections, RoPE and the weights of the compressors
and the lightning indexer. Where a layer's values live in the KV cache groups is model/dsv4_cache.py's
(bound to the layer with its group tensors); the paged work (writing the cache, closing compression groups, choosing the
indexer's top-k, attending) is the backend's ("name_dsv4", e.g. model/torch_dsv4_attention.py).

Every layer kind attends one shared K=V head: a sliding window of `sliding_window` tokens (the
current one included) plus, for compressed layers, compressed entries of `ratio` tokens each: all
closed ones (HCA) or the indexer's top `index_topk` (CSA, whose entries overlap: entry g pools the
Ca half of group g-1 and the Cb half of group g). RoPE is interleaved on the trailing rope dims,
plain (rope_theta) on sliding layers, YaRN (compress_rope_theta) on compressed layers, their
compressors and the indexer; the output's rope dims are rotated back at the query position.

This file must never touch the cache tensors themselves.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rackserve.model.attention import AttentionLayerBase, KVCacheSpec, get_attn_backend
from rackserve.distributed.parallel_state import GroupCoordinator
from rackserve.model.layers import (SINGLE, ColumnParallelLinear, Held, Linear, RMSNorm, RowParallelLinear, _param,
                                    default_weight_loader)
from rackserve.model.rotary import inverse_frequencies, rope_attention_factor

if TYPE_CHECKING:
    from rackserve.model.dsv4_cache import LayerCache

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
_RATIO_KIND = {0: SLIDING, 4: CSA, 128: HCA}


def layer_kinds(config: dict[str, Any]) -> list[str]:
    """Each layer's attention kind: `layer_types`, or the legacy per-layer `compress_ratios`."""
    n = config["num_hidden_layers"]
    if config.get("layer_types"):
        return list(config["layer_types"][:n])
    if config.get("compress_ratios"):
        return [_RATIO_KIND[r] for r in config["compress_ratios"][:n]]
    return [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]


def compress_ratio(config: dict[str, Any], kind: str) -> int:
    rates = config.get("compress_rates") or {CSA: 4, HCA: 128}
    return 0 if kind == SLIDING else int(rates[kind])


def rope_dim(config: dict[str, Any]) -> int:
    if config.get("qk_rope_head_dim"):
        return int(config["qk_rope_head_dim"])
    return int(config["head_dim"] * (config.get("partial_rotary_factor") or 64 / 512))


def rope_params(config: dict[str, Any], which: str) -> dict[str, Any]:
    """"main" (sliding layers) or "compress" (compressed layers, compressors, indexer)."""
    nested = config.get("rope_parameters") or {}
    if isinstance(nested.get(which), dict):
        params = dict(nested[which])
    elif which == "main":
        params = {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)}
    else:
        params = {**(config.get("rope_scaling") or {}), "rope_theta": config.get("compress_rope_theta", 160000.0)}
        params["rope_type"] = params.get("rope_type", params.get("type", "default"))
        if params["rope_type"] == "yarn":
            params.setdefault("attention_factor", 1.0)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


class InterleavedRope(nn.Module):
    """cos/sin of one rope rule, one entry per channel pair, computed for any positions."""

    def __init__(self, dim: int, params: dict[str, Any]):
        super().__init__()
        self.dim, self.factor = dim, rope_attention_factor(params)
        self.register_buffer("inv_freq", inverse_frequencies(dim, params), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq
        return freqs.cos() * self.factor, freqs.sin() * self.factor


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 2 * cos.shape[-1] channels of x ([T, ..., D]) in (even, odd) pairs;
    cos, sin: [T, rope_dim / 2]. Computed in float32, as transformers does."""
    half = cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.view(shape), sin.view(shape)
    pairs = x[..., -2 * half:].float().unflatten(-1, (half, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], dim=-1).flatten(-2)
    return torch.cat([x[..., :-2 * half], rotated.to(x.dtype)], dim=-1)


class Compressor(nn.Module):
    """A compressor's weights ("compressor" or "indexer.compressor"): raw kv and gate per token
    (2 series, Ca and Cb, when overlapping), a learned bias per slot of the group (`ape`), and the
    norm of the pooled entry."""

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float):
        super().__init__()
        width = (2 if overlap else 1) * dim
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        self.wkv, self.wgate = Linear(hidden, width), Linear(hidden, width)
        self.ape = _param(ratio, width)
        self.ape.weight_loader = default_weight_loader
        self.norm = RMSNorm(dim, eps)


class Indexer(nn.Module):
    """The lightning indexer's weights: its own overlapping compressor, queries from the attention's
    q_residual, and per-head score weights."""

    def __init__(self, config: dict[str, Any], ratio: int):
        super().__init__()
        hidden, self.num_heads, self.head_dim = config["hidden_size"], config["index_n_heads"], config["index_head_dim"]
        self.topk = config["index_topk"]
        self.compressor = Compressor(hidden, self.head_dim, ratio, True, config.get("rms_norm_eps", 1e-6))
        self.wq_b = Linear(config["q_lora_rank"], self.num_heads * self.head_dim)
        self.weights_proj = Linear(hidden, self.num_heads)


class DeepseekV4Attention(AttentionLayerBase):
    """One layer's attention ("layers.i.attn" in checkpoints); names follow DeepSeek's checkpoints.

    Under tensor parallelism each rank takes whole output groups (o_groups / tp of them) and their
    heads: wq_b's rows, the sinks and wo_a's groups by heads, wo_b by input columns (its all-reduce
    ends the layer). The shared KV head, the compressors and the indexer are replicated: every rank
    caches the whole per-token entry and chooses the same top-k."""

    def __init__(self, config: dict[str, Any], kind: str, attn_backend: str, tp: GroupCoordinator = SINGLE):
        super().__init__()
        hidden, heads, hd = config["hidden_size"], config["num_attention_heads"], config["head_dim"]
        groups, d_g = config["o_groups"], config["o_lora_rank"]
        if groups % tp.world_size:
            raise ValueError(f"tensor_parallel_size={tp.world_size} must divide o_groups={groups}")
        eps = config.get("rms_norm_eps", 1e-6)
        self.kind, self.head_dim, self.eps = kind, hd, eps
        self.ratio = compress_ratio(config, kind)
        self.window = config["sliding_window"]
        self.o_groups = groups // tp.world_size
        first_group, per_group = tp.rank_in_group * self.o_groups, heads // groups
        first_head, self.num_heads = first_group * per_group, self.o_groups * per_group
        self.wq_a = Linear(hidden, config["q_lora_rank"])
        self.q_norm = RMSNorm(config["q_lora_rank"], eps)
        self.wq_b = ColumnParallelLinear(config["q_lora_rank"], heads * hd, tp=tp,
                                         held=[Held(heads * hd, first_head * hd, self.num_heads * hd)])
        self.wkv = Linear(hidden, hd)
        self.norm = RMSNorm(hd, eps)
        self.wo_a = ColumnParallelLinear(heads * hd // groups, groups * d_g, tp=tp,
                                         held=[Held(groups * d_g, first_group * d_g, self.o_groups * d_g)])
        self.wo_b = RowParallelLinear(groups * d_g, hidden, False, tp,
                                      input_held=(first_group * d_g, self.o_groups * d_g))
        self.attn_sink = _param(self.num_heads)
        self.attn_sink.weight_loader = lambda p, loaded: default_weight_loader(p, loaded.narrow(0, first_head,
                                                                                              self.num_heads))
        self.compressor = Compressor(hidden, hd, self.ratio, kind == CSA, eps) if kind != SLIDING else None
        self.indexer = Indexer(config, self.ratio) if kind == CSA else None
        self.rope = InterleavedRope(rope_dim(config), rope_params(config, "main" if kind == SLIDING else "compress"))
        self.compress_rope = InterleavedRope(rope_dim(config), rope_params(config, "compress"))
        # Names the backend family only: the cache's shapes are the groups' (model/dsv4_cache.py).
        self.kv_cache_spec = KVCacheSpec(1, hd, family="dsv4")
        self.cache: LayerCache | None = None     # this layer's channels in the groups, set with kv_cache
        self.impl = get_attn_backend(attn_backend, family="dsv4")()

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        assert self.kv_cache is not None, "no KV cache bound: call bind_kv_cache() first"
        t, hd = x.shape[0], self.head_dim
        cos, sin = self.rope(positions)
        q_residual = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_residual).view(t, self.num_heads, hd)
        q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + self.eps).to(q.dtype)
        q = apply_interleaved_rope(q, cos, sin)
        kv = apply_interleaved_rope(self.norm(self.wkv(x)), cos, sin)
        o = self.impl.forward(self, q, kv, x, q_residual, positions, self.kv_cache, attn_metadata)
        o = apply_interleaved_rope(o, cos, -sin)               # K = V carried rope into the values
        # Sizes spelled out: an idle DP rank's forward of zero tokens cannot infer a -1.
        per_group = self.num_heads * hd // self.o_groups
        grouped = o.reshape(t, self.o_groups, per_group).transpose(0, 1)      # [groups, T, in]
        w = self.wo_a.weight.view(self.o_groups, -1, per_group)               # [groups, d_g, in]
        return self.wo_b(torch.bmm(grouped, w.transpose(1, 2)).transpose(0, 1).reshape(t, self.wo_a.output_size))
