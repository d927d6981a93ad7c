"""MoE routing: which top-k experts each token goes to, and with what weights.

RoutingConfig states a model's rule (softmax top-k for Qwen3-MoE; sigmoid scores, a selection-only
correction bias, group-limited top-k and a scaling factor for DeepSeek-V3). A gate implements it
(registry by name: "plain" here, "pruned" in model/pruned_gate.py); the MoEGate module (the
layer's `gate`) holds the checkpoint's gate weight and bias in float32 and calls its gate on
float32 inputs, so routing does not change with the model's dtype (transformers keeps DeepSeek-V3's gate in float32 too).

Every gate breaks ties toward the lower expert id (and the lower group id), so that gates which
see equal scores choose alike. This file must never move tokens or touch expert weights.
"""
from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from rackserve.model.layers import default_weight_loader
from rackserve.registry import Registry


@dataclass(frozen=True)
class RoutingConfig:
    num_experts: int
    top_k: int
    scoring: str                        # "softmax" | "sigmoid"
    norm_topk_prob: bool                # weights renormalised over the chosen experts
    num_groups: int = 1                 # experts split into groups; a token uses only the
    topk_groups: int = 1                # topk_groups groups with the best top-2 score sums
    routed_scaling_factor: float = 1.0
    use_correction_bias: bool = False   # e_score_correction_bias: added to scores for choosing only

    def __post_init__(self) -> None:
        assert self.scoring in ("softmax", "sigmoid"), f"unknown scoring {self.scoring!r}"
        assert 0 < self.top_k <= self.num_experts and self.num_experts % self.num_groups == 0
        assert self.num_groups == 1 or (self.num_experts // self.num_groups >= 2 and
                                         0 < self.topk_groups <= self.num_groups and
                                         self.top_k <= self.topk_groups * self.num_experts // self.num_groups)
        assert not self.use_correction_bias or self.scoring == "sigmoid"


class Routing(NamedTuple):
    topk_ids: torch.Tensor              # [T, top_k] int64 global expert ids
    topk_weights: torch.Tensor          # [T, top_k] float32


def topk_lowest_first(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values of each row; among equal values the lower index first."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def choice_scores(cfg: RoutingConfig, logits: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What experts are ranked by. Softmax is monotonic, so ranking logits ranks probabilities."""
    if cfg.scoring == "softmax":
        return logits
    scores = logits.sigmoid()
    return scores + bias if bias is not None else scores


def group_scores(cfg: RoutingConfig, scores: torch.Tensor) -> torch.Tensor:
    """[T, num_groups]: each group's two best choice scores, summed (DeepSeek-V3's rule)."""
    # Sizes spelled out: an empty batch (an idle DP rank's forward) cannot infer a -1.
    per_group = scores.view(scores.shape[0], cfg.num_groups, cfg.num_experts // cfg.num_groups)
    return per_group.topk(2, dim=-1).values.sum(-1)


def expert_mask_of_groups(cfg: RoutingConfig, group_ids: torch.Tensor) -> torch.Tensor:
    """[T, num_experts] bool: the experts of the given groups ([T, n] group ids)."""
    groups = torch.zeros(group_ids.shape[0], cfg.num_groups, dtype=torch.bool, device=group_ids.device)
    groups.scatter_(1, group_ids, True)
    return groups.repeat_interleave(cfg.num_experts // cfg.num_groups, dim=1)


def sampled_logits(x: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x_t . w_e for each True (t, e) of mask [T, E], in the mask's row-major order: one sampled
    dense-dense matmul (SDDMM), which reads the rows it needs without gathering copies of them."""
    counts = mask.sum(1)
    cols = mask.nonzero()[:, 1]
    if cols.numel() == 0:
        return x.new_empty(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)        # "sparse CSR tensor support is in beta"
        pattern = torch.sparse_csr_tensor(F.pad(counts.cumsum(0), (1, 0)), cols, x.new_zeros(cols.shape[0]),
                                          mask.shape)
    return torch.sparse.sampled_addmm(pattern, x, weight.t(), beta=0.0).values()


def chosen_logits(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[T, k] logits of the chosen experts (ids [T, k], distinct per row), recomputed the one way
    every gate uses for the weights: equal choices then give bitwise equal weights, whatever
    each gate's scoring rounded."""
    mask = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.bool, device=x.device).scatter_(1, ids, True)
    by_id = sampled_logits(x, weight, mask).view(ids.shape)
    return by_id.gather(1, ids.argsort(-1).argsort(-1))


def weights_from_logits(cfg: RoutingConfig, logits: torch.Tensor) -> torch.Tensor:
    """Routing weights from the chosen experts' logits [T, k] alone (all rules but softmax without
    norm_topk_prob, whose weights need every expert's logit)."""
    if cfg.scoring == "softmax":
        assert cfg.norm_topk_prob
        weights = logits.softmax(-1)
    else:
        weights = logits.sigmoid()
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor


class Gate(ABC):
    """One way to compute a RoutingConfig's choice. `prepare` is called once the gate's
    weights are loaded; `select` must give the plain gate's experts."""

    def __init__(self, cfg: RoutingConfig):
        self.cfg = cfg

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Precompute what select needs from the weights (nothing by default)."""

    @abstractmethod
    def select(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Routing:
        """x: [T, hidden] float32; weight: [num_experts, hidden] float32; bias: [num_experts]."""


GATES: Registry[type[Gate]] = Registry("gate", "rackserve.model.{}_gate")   # gate "x" lives in x_gate.py
register_gate, get_gate = GATES.register, GATES.get


@register_gate("plain")
class PlainGate(Gate):
    """Every expert's logit with one GEMM, then the rule as transformers states it."""

    def select(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Routing:
        cfg = self.cfg
        logits = F.linear(x, weight)
        scores = choice_scores(cfg, logits, bias)
        if cfg.num_groups > 1:
            chosen = expert_mask_of_groups(cfg, topk_lowest_first(group_scores(cfg, scores), cfg.topk_groups))
            scores = scores.masked_fill(~chosen, float("-inf"))
        ids = topk_lowest_first(scores, cfg.top_k)
        if cfg.scoring == "softmax" and not cfg.norm_topk_prob:
            return Routing(ids, logits.softmax(-1).gather(1, ids))
        return Routing(ids, weights_from_logits(cfg, chosen_logits(x, weight, ids)))


class MoEGate(nn.Module):
    """An MoE layer's gate ("mlp.gate" in checkpoints): float32 weight [num_experts, hidden] and,
    for DeepSeek-V3, e_score_correction_bias [num_experts]."""

    def __init__(self, hidden_size: int, cfg: RoutingConfig, gate: str = "plain"):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.e_score_correction_bias: nn.Parameter | None = None
        if cfg.use_correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(cfg.num_experts, dtype=torch.float32),
                                                        requires_grad=False)
            self.e_score_correction_bias.weight_loader = default_weight_loader
        self.gate = get_gate(gate)(cfg)

    def process_weights_after_loading(self) -> None:
        self.gate.prepare(self.weight, self.e_score_correction_bias)

    def forward(self, x: torch.Tensor) -> Routing:
        return self.gate.select(x.float(), self.weight, self.e_score_correction_bias)
