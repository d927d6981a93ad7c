"""DeepSeek-V3: multi-head latent attention with a compressed latent KV cache, and DeepSeekMoE:
sigmoid scores with a selection-only correction bias, group-limited top-k, routed_scaling_factor
and shared experts; the first first_k_dense_replace layers (and those off the moe_layer_freq
stride, as vLLM reads it) keep a dense MLP.

Attention: q comes from q_proj, or through the q_lora_rank bottleneck (q_a_proj, RMSNorm,
q_b_proj); kv_a_proj_with_mqa gives the compressed KV (normalised, then cached) and the shared
rope key; the MLA op (model/mla.py) caches both and expands or absorbs kv_b_proj. Checkpoints
with rope_interleave (the default) store each rope part in interleaved pairs; their rows are
permuted at load time so that the ordinary rotate-half RoPE computes transformers' interleaved
result. With yarn RoPE the softmax scale grows by mscale(factor, mscale_all_dim)^2. Tensors of
the multi-token-prediction layers past num_hidden_layers are skipped.

Tensor parallelism splits MLA as vLLM does: the heads (q_b_proj, or q_proj, and kv_b_proj column-
parallel by heads, o_proj row-parallel) but not the latent (q_a_proj and kv_a_proj_with_mqa are
replicated, and every rank caches the whole latent, for its own heads to read); the absorbed decode
path works per local head. The experts split as FusedMoE does; the shared experts split like an
MLP whose down projection leaves its partial sum to FusedMoE's one all-reduce. This file must never
duplicate the shared skeleton's layers.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from rackserve.distributed.parallel_state import GroupCoordinator, ParallelGroups
from rackserve.model.layers import (SINGLE, ColumnParallelLinear, Held, Linear, MergedLinear, RMSNorm,
                                    RowParallelLinear, silu_and_mul, split_evenly)
from rackserve.model.mla import MLAAttention
from rackserve.model.models.llama import DecoderLayer, LlamaMLP
from rackserve.model.models.moe_decoder import MoECausalLM
from rackserve.model.moe import FusedMoE
from rackserve.model.rotary import apply_rope, rope_parameters, yarn_mscale
from rackserve.model.gate import MoEGate, RoutingConfig

# transformers builds the latent norms with RMSNorm's default eps, whatever rms_norm_eps says.
LATENT_NORM_EPS = 1e-6


def deinterleave_rows(weight_loader: Callable[..., None], head_size: int, rope_dim: int) -> Callable[..., None]:
    """Wrap a weight loader so that in each head of `head_size` rows, the last `rope_dim` rows
    (pairs x0 x1, x2 x3, ...) are reordered evens-then-odds before loading."""
    def load(param: nn.Parameter, loaded: torch.Tensor, *shard: object) -> None:
        heads = loaded.view(-1, head_size, *loaded.shape[1:])
        rope = heads[:, head_size - rope_dim:]
        heads = torch.cat([heads[:, :head_size - rope_dim], rope[:, 0::2], rope[:, 1::2]], dim=1)
        weight_loader(param, heads.reshape(loaded.shape), *shard)
    return load


class DeepseekV3Attention(nn.Module):
    """num_heads is this rank's share of the heads."""

    def __init__(self, config: dict[str, Any], attn_backend: str, tp: GroupCoordinator = SINGLE):
        super().__init__()
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        self.nope, self.rope = config["qk_nope_head_dim"], config["qk_rope_head_dim"]
        self.rank, v_dim, q_lora = config["kv_lora_rank"], config["v_head_dim"], config.get("q_lora_rank")
        qk_head, bias = self.nope + self.rope, bool(config.get("attention_bias", False))
        if tp.world_size > heads:
            raise ValueError(f"tensor_parallel_size={tp.world_size} exceeds the {heads} attention heads")
        first, self.num_heads = split_evenly(heads, tp.world_size, tp.rank_in_group)

        def by_heads(input_size: int, head_size: int) -> ColumnParallelLinear:
            held = Held(heads * head_size, first * head_size, self.num_heads * head_size)
            return ColumnParallelLinear(input_size, heads * head_size, tp=tp, held=[held])
        self.q_lora_rank = q_lora
        if q_lora:
            self.q_a_proj = Linear(hidden, q_lora, bias)
            self.q_a_layernorm = RMSNorm(q_lora, LATENT_NORM_EPS)
            self.q_b_proj = by_heads(q_lora, qk_head)
        else:
            self.q_proj = by_heads(hidden, qk_head)
        self.kv_a_proj_with_mqa = Linear(hidden, self.rank + self.rope, bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = by_heads(self.rank, self.nope + v_dim)
        self.o_proj = RowParallelLinear(heads * v_dim, hidden, bias, tp,
                                        input_held=(first * v_dim, self.num_heads * v_dim))
        if config.get("rope_interleave", True):
            # The rows are permuted whole, before the column-parallel loader keeps its heads' rows.
            q_last = self.q_b_proj if q_lora else self.q_proj
            q_last.weight.weight_loader = deinterleave_rows(q_last.weight.weight_loader, qk_head, self.rope)
            kv_a = self.kv_a_proj_with_mqa
            for p in (kv_a.weight, kv_a.bias):
                if p is not None:
                    p.weight_loader = deinterleave_rows(p.weight_loader, self.rank + self.rope, self.rope)
        scale = qk_head ** -0.5
        params = rope_parameters(config)
        if params["rope_type"] != "default" and params.get("mscale_all_dim"):
            scale *= yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"])) ** 2
        self.mla_attn = MLAAttention(self.num_heads, self.rank, self.nope, self.rope, v_dim, scale, self.kv_b_proj,
                                     attn_backend)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(x.shape[0], self.num_heads, self.nope + self.rope)
        q[..., self.nope:] = apply_rope(q[..., self.nope:], cos, sin)
        kv = self.kv_a_proj_with_mqa(x)
        kv_c = self.kv_a_layernorm(kv[:, :self.rank])
        k_pe = apply_rope(kv[:, None, self.rank:], cos, sin)[:, 0]
        return self.o_proj(self.mla_attn(q, kv_c, k_pe, attn_metadata))


class DeepseekV3SharedExperts(nn.Module):
    """The n_shared_experts shared experts, one SiLU MLP of n_shared_experts x moe_intermediate_size
    features, split over `tp` like LlamaMLP; its down projection holds this rank's input columns
    but reduces over no group (SINGLE), leaving its partial sum to FusedMoE's all-reduce."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: GroupCoordinator):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], False, tp)
        held = split_evenly(intermediate_size, tp.world_size, tp.rank_in_group)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, SINGLE, input_held=held)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DeepseekV3MoE(nn.Module):
    def __init__(self, config: dict[str, Any], groups: ParallelGroups):
        super().__init__()
        assert config.get("hidden_act", "silu") == "silu", f"unsupported activation {config.get('hidden_act')}"
        method = (config.get("topk_method", "noaux_tc"), config.get("scoring_func", "sigmoid"))
        assert method == ("noaux_tc", "sigmoid"), f"routing {method}: only DeepSeek-V3's noaux_tc + sigmoid is known"
        hidden, num_experts = config["hidden_size"], config["n_routed_experts"]
        routing = RoutingConfig(num_experts, config["num_experts_per_tok"], "sigmoid",
                                bool(config.get("norm_topk_prob", True)), config.get("n_group") or 1,
                                config.get("topk_group") or 1, float(config.get("routed_scaling_factor", 1.0)),
                                use_correction_bias=True)
        self.gate = MoEGate(hidden, routing)
        self.experts = FusedMoE(num_experts, hidden, config["moe_intermediate_size"], groups=groups)
        shared = config.get("n_shared_experts") or 0
        self.shared_experts = (DeepseekV3SharedExperts(hidden, config["moe_intermediate_size"] * shared, groups.tp)
                               if shared else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x), self.shared_experts)


class DeepseekV3ForCausalLM(MoECausalLM):
    stacked_params = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def make_layer(self, config: dict[str, Any], layer_idx: int, attn_backend: str,
                   groups: ParallelGroups) -> nn.Module:
        sparse = (config.get("n_routed_experts") and layer_idx >= config.get("first_k_dense_replace", 0)
                  and layer_idx % config.get("moe_layer_freq", 1) == 0)
        mlp = DeepseekV3MoE(config, groups) if sparse else LlamaMLP(config, groups.tp)
        return DecoderLayer(config, DeepseekV3Attention(config, attn_backend, groups.tp), mlp)

    @staticmethod
    def rope_dim(config: dict[str, Any]) -> int:
        return config["qk_rope_head_dim"]

    def skip_weight(self, name: str) -> bool:
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        return super().skip_weight(name) or (layer is not None and int(layer[1]) >= self.config["num_hidden_layers"])
