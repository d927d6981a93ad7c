"""DeepSeek-V4: sliding, compressed-sparse (CSA) and heavily-compressed (HCA) attention layers
(model/dsv4_attention.py), manifold-constrained hyper-connections (mHC) instead of a residual, and
DeepSeekMoE with sqrtsoftplus scores, hash-routed first layers, a shared expert and a SwiGLU clamp.

mHC: the residual is hc_mult streams [T, hc, hidden]. Before each sublayer (attention, FFN) a
projection of the RMS-normed streams gives `pre` (how the streams collapse into the sublayer's
input), `post` (how its output spreads back) and `comb` (how the streams mix, made doubly
stochastic by Sinkhorn-Knopp); after the last layer a hyper head collapses them for the final norm.
The hash-routed layers take their experts from a frozen token-to-expert table (`tid2eid`) and only
their weights from the gate; the others take the top-k of sqrtsoftplus(logits) + correction bias.

Checkpoints are read in DeepSeek's own names (what transformers writes: layers.i.attn.wq_a,
ffn.experts.e.w1, hc_attn_fn, ...), with or without the "model." prefix. FP8/FP4 checkpoints
(block scales) are refused with a clear error. Under tensor parallelism the attention splits by
output groups (dsv4_attention.py), the experts as FusedMoE does, the embedding and head by
vocabulary; mHC and the MoE gate are replicated. This file must never touch the KV cache other than
through its attention layers.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rackserve.distributed.parallel_state import GroupCoordinator, ParallelGroups
from rackserve.model.dsv4_attention import DeepseekV4Attention, layer_kinds
from rackserve.model.dsv4_cache import DSV4CacheGroups
from rackserve.model.layers import (SINGLE, LMHead, MergedLinear, RMSNorm, RowParallelLinear, VocabEmbedding,
                                    default_weight_loader, split_evenly)
from rackserve.model.models.weights import WeightTracker, stacked_shards, stacked_target
from rackserve.model.moe import FusedMoE, TorchMoEBackend
from rackserve.model.gate import Routing, topk_lowest_first

_EXPERT = re.compile(r"^(?P<moe>layers\.\d+\.ffn\.experts)\.(?P<e>\d+)\.(?P<w>w[123])\.weight$")
_HC = re.compile(r"hc_(attn|ffn)_(fn|base|scale)$")
_RENAMES = {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight", "hc_head.hc_fn": "hc_head_fn",
            "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}


def clamped_swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class ClampedSwiGLUMoEBackend(TorchMoEBackend):
    def __init__(self, limit: float):
        self.limit = limit

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        return clamped_swiglu(gate_up, self.limit)


def fp32_param(*shape: int) -> nn.Parameter:
    # mHC and MoE gate weights stay float32 whatever the model's dtype, as in transformers.
    p = nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)
    p.weight_loader = default_weight_loader
    return p


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    """One sublayer's mHC weights (hc_attn_* or hc_ffn_* of a layer)."""

    def __init__(self, config: dict[str, Any]):
        super().__init__()
        hc = self.hc = config.get("hc_mult", 4)
        self.iters, self.eps = config.get("hc_sinkhorn_iters", 20), config.get("hc_eps", 1e-6)
        self.norm_eps = config.get("rms_norm_eps", 1e-6)
        self.fn = fp32_param((2 + hc) * hc, hc * config["hidden_size"])
        self.base, self.scale = fp32_param((2 + hc) * hc), fp32_param(3)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, hc, D] -> post [T, hc], comb [T, hc, hc], the collapsed input [T, D]."""
        hc = self.hc
        mixes = F.linear(unweighted_rms(streams.flatten(1).float(), self.norm_eps), self.fn)
        pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb_w = comb_w.view(comb_w.shape[0], hc, hc)      # sizes spelled out: zero tokens cannot infer a -1
        comb = torch.softmax(comb_w * self.scale[2] + comb_b.view(hc, hc), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        return post, comb, (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def hc_residual(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """x'_k = post_k * out + sum_j comb[j, k] x_j."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(1) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class DeepseekV4Gate(nn.Module):
    """The MoE gate ("ffn.gate"): float32 weight; a correction bias (routed layers) or the frozen
    token-to-expert table (hash layers)."""

    def __init__(self, config: dict[str, Any], hashed: bool):
        super().__init__()
        e, self.top_k = config["n_routed_experts"], config["num_experts_per_tok"]
        self.scale = float(config.get("routed_scaling_factor", 1.0))
        assert config.get("scoring_func", "sqrtsoftplus") == "sqrtsoftplus", f"scoring {config.get('scoring_func')}"
        self.weight = fp32_param(e, config["hidden_size"])
        if hashed:
            self.tid2eid = nn.Parameter(torch.empty(config["vocab_size"], self.top_k, dtype=torch.long),
                                        requires_grad=False)
            self.tid2eid.weight_loader = default_weight_loader
        else:
            self.bias = fp32_param(e)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> Routing:
        scores = F.softplus(F.linear(x.float(), self.weight)).sqrt()
        if hasattr(self, "tid2eid"):
            ids = self.tid2eid[input_ids]
        else:
            ids = topk_lowest_first(scores + self.bias, self.top_k)
        weights = scores.gather(1, ids)
        return Routing(ids, weights / (weights.sum(-1, keepdim=True) + 1e-20) * self.scale)


class SharedExperts(nn.Module):
    """w1/w3 (gate/up) column-split, w2 row-split leaving its partial sum to FusedMoE's all-reduce."""

    def __init__(self, hidden: int, inter: int, limit: float, tp: GroupCoordinator):
        super().__init__()
        self.limit = limit
        self.w13 = MergedLinear(hidden, [inter, inter], False, tp)
        self.w2 = RowParallelLinear(inter, hidden, False, SINGLE, input_held=split_evenly(inter, tp.world_size,
                                                                                          tp.rank_in_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(clamped_swiglu(self.w13(x), self.limit))


class DeepseekV4MoE(nn.Module):
    def __init__(self, config: dict[str, Any], hashed: bool, groups: ParallelGroups):
        super().__init__()
        hidden, inter = config["hidden_size"], config["moe_intermediate_size"]
        limit = float(config.get("swiglu_limit", 10.0))
        self.gate = DeepseekV4Gate(config, hashed)
        self.experts = FusedMoE(config["n_routed_experts"], hidden, inter, groups=groups)
        self.experts.backend = ClampedSwiGLUMoEBackend(limit)
        shared = config.get("n_shared_experts") or 0
        self.shared_experts = SharedExperts(hidden, inter * shared, limit, groups.tp) if shared else None

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x, input_ids), self.shared_experts)


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, config: dict[str, Any], layer_idx: int, attn_backend: str, groups: ParallelGroups):
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
        n_hash = config.get("num_hash_layers", 3)
        mlp_types = config.get("mlp_layer_types") or ["hash_moe"] * n_hash + ["moe"] * config["num_hidden_layers"]
        self.attn = DeepseekV4Attention(config, layer_kinds(config)[layer_idx], attn_backend, groups.tp)
        self.ffn = DeepseekV4MoE(config, mlp_types[layer_idx] == "hash_moe", groups)
        self.attn_norm, self.ffn_norm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.hc_attn, self.hc_ffn = HyperConnection(config), HyperConnection(config)

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: Any) -> torch.Tensor:
        post, comb, x = self.hc_attn(streams)
        streams = hc_residual(streams, self.attn(self.attn_norm(x), positions, attn_metadata), post, comb)
        post, comb, x = self.hc_ffn(streams)
        return hc_residual(streams, self.ffn(self.ffn_norm(x), input_ids), post, comb)


class DeepseekV4ForCausalLM(nn.Module):
    stacked_params = {"w1": ("w13", 0), "w3": ("w13", 1)}

    def __init__(self, config: dict[str, Any], attn_backend: str, max_position: int, groups: ParallelGroups):
        super().__init__()
        if config.get("quantization_config"):
            raise ValueError("DeepSeek-V4 checkpoints with FP8/FP4 block scales (quantization_config) are not "
                             "supported yet: use a bfloat16 or float32 checkpoint")
        self.config, self.hc = config, config.get("hc_mult", 4)
        hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
        self.hc_eps, self.norm_eps = config.get("hc_eps", 1e-6), eps
        self.embed = VocabEmbedding(config["vocab_size"], hidden, groups.tp)
        self.layers = nn.ModuleList([DeepseekV4DecoderLayer(config, i, attn_backend, groups)
                                     for i in range(config["num_hidden_layers"])])
        self.norm = RMSNorm(hidden, eps)
        self.hc_head_fn = fp32_param(self.hc, self.hc * hidden)
        self.hc_head_base, self.hc_head_scale = fp32_param(self.hc), fp32_param(1)
        self.head = LMHead(config["vocab_size"], hidden, None, groups.tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        streams = self.embed(input_ids).unsqueeze(1).expand(-1, self.hc, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, input_ids, positions, attn_metadata)
        mixes = F.linear(unweighted_rms(streams.flatten(1).float(), self.norm_eps), self.hc_head_fn)
        pre = torch.sigmoid(mixes * self.hc_head_scale + self.hc_head_base) + self.hc_eps
        return self.norm((pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    def kv_cache_groups(self, block_size: int) -> DSV4CacheGroups:
        """The model's KV cache groups (a model with several kinds of cache; the runner allocates
        one tensor per group and binds them with bind_kv_cache_groups)."""
        return DSV4CacheGroups(self.config, block_size)

    def bind_kv_cache_groups(self, groups: DSV4CacheGroups, tensors: list[torch.Tensor]) -> None:
        """Give each layer the window group's tensor, its kind's group tensor and its channels."""
        for layer, where in zip(self.layers, groups.layers):
            layer.attn.kv_cache = (tensors[0], tensors[where.group] if where.group else None)
            layer.attn.cache = where

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load DeepSeek-named tensors; raises on an unknown name, a quantized tensor or a parameter
        left unloaded. Multi-token-prediction tensors (mtp.*) and experts held by other ranks are
        skipped."""
        tracker = WeightTracker(self)
        moes = {n: m for n, m in self.named_modules() if isinstance(m, FusedMoE)}
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith("mtp."):
                continue
            if tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32) or \
                    name.endswith((".scale", ".weight_scale_inv")):
                raise ValueError(f"checkpoint tensor {name!r} ({tensor.dtype}) is quantized: FP8/FP4 DeepSeek-V4 "
                                 "checkpoints are not supported yet")
            name = _HC.sub(r"hc_\1.\2", _RENAMES.get(name, name))
            expert = _EXPERT.match(name)
            if expert is not None:
                if not moes[expert["moe"]].placement.holds(int(expert["e"])):
                    continue            # another expert-parallel rank's expert
                param = f"{expert['moe']}.{'w2_weight' if expert['w'] == 'w2' else 'w13_weight'}"
                tracker.load(param, tensor, (int(expert["e"]), expert["w"]))
                continue
            name, shard = stacked_target(name, self.stacked_params)
            tracker.load(name, tensor, shard)
        for name in tracker.params:
            module = name.rsplit(".", 1)[0]
            tracker.check(name, moes[module].expected_shards(tracker.params[name]) if module in moes
                          else stacked_shards(name, self.stacked_params))
