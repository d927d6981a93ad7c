"""The CausalLM base the MoE architectures share: llama.py's DecoderModel over its pre-norm
DecoderLayers, each around any attention and any MLP (dense, or a sparse MoE block), with the
interface of llama.py and a weight loader that also routes per-expert checkpoint tensors into
FusedMoE's stacked weights.

A subclass states how layer i is built (`make_layer`, handing each layer the groups it splits
over) and its RoPE dimension. The residual add is carried into the next norm as in Llama. Under
tensor parallelism the embedding and lm_head split the vocabulary over groups.tp as in Llama.
This file must never hold an architecture's own layers.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from rackserve.distributed.parallel_state import ParallelGroups
from rackserve.model.layers import LMHead
from rackserve.model.models.llama import DecoderModel
from rackserve.model.models.weights import WeightTracker, stacked_shards, stacked_target
from rackserve.model.moe import FusedMoE, expert_checkpoint_name


class MoECausalLM(nn.Module, ABC):
    # checkpoint name part -> (our fused parameter's name part, shard id)
    stacked_params: dict[str, tuple[str, object]] = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: dict[str, Any], attn_backend: str, max_position: int, groups: ParallelGroups):
        super().__init__()
        self.config = config
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
        layers = [self.make_layer(config, i, attn_backend, groups) for i in range(config["num_hidden_layers"])]
        self.model = DecoderModel(config, layers, self.rope_dim(config), max_position, groups.tp)
        self.lm_head = LMHead(config["vocab_size"], config["hidden_size"],
                              self.model.embed_tokens if self.tie_word_embeddings else None, groups.tp)

    @abstractmethod
    def make_layer(self, config: dict[str, Any], layer_idx: int, attn_backend: str,
                   groups: ParallelGroups) -> nn.Module:
        """Decoder layer `layer_idx`: a DecoderLayer with this architecture's attention and MLP."""

    @staticmethod
    @abstractmethod
    def rope_dim(config: dict[str, Any]) -> int:
        """How many dimensions of each head RoPE rotates."""

    def skip_weight(self, name: str) -> bool:
        """Checkpoint tensors that no parameter takes."""
        return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.tie_word_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; raises on an unknown name or a parameter left unloaded. Tensors
        of experts this rank does not hold are skipped."""
        tracker = WeightTracker(self)
        moes = {name: m for name, m in self.named_modules() if isinstance(m, FusedMoE)}
        for name, tensor in weights:
            if self.skip_weight(name):
                continue
            expert = expert_checkpoint_name(name)
            if expert is None:
                name, shard = stacked_target(name, self.stacked_params)
            else:
                moe_name, name, shard = expert
                if moe_name not in moes:
                    raise KeyError(f"checkpoint tensor of expert {shard} has no MoE layer {moe_name!r}")
                if not moes[moe_name].placement.holds(shard[0]):
                    continue
            tracker.load(name, tensor, shard)
        for name, param in tracker.params.items():
            module = name.rsplit(".", 1)[0]
            tracker.check(name, moes[module].expected_shards(param) if module in moes
                          else stacked_shards(name, self.stacked_params))
        for module in self.modules():
            if hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()
