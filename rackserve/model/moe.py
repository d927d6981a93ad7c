"""The MoE layer (vLLM's FusedMoE): routed experts with stacked weights, cut at the seams that expert
parallelism needs: which experts this rank holds (ExpertPlacement), moving tokens to the ranks
that hold their experts and back (MoEDispatcher: dispatch, then combine), and the grouped expert
compute (MoEBackend, a registry by name).

Weights are stacked per layer: w13_weight [E_local, 2 * I, H] (each expert's gate_proj rows, then
its up_proj rows) and w2_weight [E_local, H, I] (down_proj), where E_local is this rank's slice of
the experts; per-expert checkpoint tensors load into them by (expert id, "w1" | "w3" | "w2"). In
one process the placement holds every expert and dispatch/combine are the identity; an
all-to-all dispatcher and a slice of E are all that expert parallelism changes. This file must
never choose experts (model/router.py does) nor know any architecture.
"""
from __future__ import annotations

import importlib
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from rackserve.model.layers import default_weight_loader, silu_and_mul
from rackserve.model.router import Routing

# "model.layers.3.mlp.experts.17.gate_proj.weight": one expert's tensor in a checkpoint.
_EXPERT_TENSOR = re.compile(r"^(?P<moe>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_SHARD_OF_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def expert_checkpoint_name(name: str) -> tuple[str, str, tuple[int, str]] | None:
    """(FusedMoE module name, its parameter name, shard id) of a per-expert checkpoint tensor;
    None for any other tensor."""
    m = _EXPERT_TENSOR.match(name)
    if m is None:
        return None
    shard = _SHARD_OF_PROJ[m["proj"]]
    return m["moe"], f"{m['moe']}.{'w2_weight' if shard == 'w2' else 'w13_weight'}", (int(m["expert"]), shard)


@dataclass(frozen=True)
class ExpertPlacement:
    """The experts this rank holds: global ids [first, first + num_local) of num_experts."""
    num_experts: int
    first: int
    num_local: int

    @classmethod
    def all_local(cls, num_experts: int) -> "ExpertPlacement":
        return cls(num_experts, 0, num_experts)

    def holds(self, expert: int) -> bool:
        return self.first <= expert < self.first + self.num_local

    def to_local(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids to this rank's local ones; -1 for experts held elsewhere."""
        local = topk_ids - self.first
        return local.masked_fill((local < 0) | (local >= self.num_local), -1)


class DispatchedTokens(NamedTuple):
    """The tokens one rank computes experts for, after dispatch."""
    hidden: torch.Tensor                # [N, H]
    topk_ids: torch.Tensor              # [N, top_k] local expert ids; -1: held by another rank
    topk_weights: torch.Tensor          # [N, top_k]
    handle: Any                         # what combine needs to send results back (None locally)


class MoEDispatcher(ABC):
    @abstractmethod
    def dispatch(self, hidden: torch.Tensor, routing: Routing) -> DispatchedTokens:
        """Send each token to the ranks holding its chosen experts."""

    @abstractmethod
    def combine(self, expert_out: torch.Tensor, tokens: DispatchedTokens) -> torch.Tensor:
        """expert_out [N, H], each dispatched token's weighted expert sum on this rank, back to
        [T, H] for the tokens this rank dispatched (summed over the ranks that computed them)."""


class LocalDispatcher(MoEDispatcher):
    """One rank holds every expert (or computes only for its own tokens): the identity."""

    def __init__(self, placement: ExpertPlacement):
        self.placement = placement

    def dispatch(self, hidden: torch.Tensor, routing: Routing) -> DispatchedTokens:
        return DispatchedTokens(hidden, self.placement.to_local(routing.topk_ids), routing.topk_weights, None)

    def combine(self, expert_out: torch.Tensor, tokens: DispatchedTokens) -> torch.Tensor:
        return expert_out


class MoEBackend(ABC):
    @abstractmethod
    def apply(self, tokens: DispatchedTokens, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """[N, H]: for each token, the sum over its experts held here of weight * expert(token)."""


MOE_BACKENDS: dict[str, type[MoEBackend]] = {}


def register_moe_backend(name: str):
    def wrap(cls: type[MoEBackend]) -> type[MoEBackend]:
        MOE_BACKENDS[name] = cls
        return cls
    return wrap


def get_moe_backend(name: str) -> type[MoEBackend]:
    if name not in MOE_BACKENDS:
        try:
            importlib.import_module(f"rackserve.model.{name}_moe")      # backend "x" lives in x_moe.py
        except ModuleNotFoundError:
            pass
    if name not in MOE_BACKENDS:
        raise ValueError(f"unknown MoE backend {name!r}; known: {sorted(MOE_BACKENDS)}")
    return MOE_BACKENDS[name]


@register_moe_backend("torch")
class TorchMoEBackend(MoEBackend):
    """Sort the (token, expert) pairs by expert, one gate_up and one down matmul per active expert
    over its contiguous rows, scale by the routing weights, unsort and sum each token's pairs."""

    def apply(self, tokens: DispatchedTokens, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        hidden, ids = tokens.hidden, tokens.topk_ids.flatten()
        top_k, num_local = tokens.topk_ids.shape[1], w13.shape[0]
        order = ids.argsort(stable=True)
        # counts[0]: pairs whose expert is held elsewhere (id -1), sorted first and skipped.
        counts = torch.bincount(ids + 1, minlength=num_local + 1).tolist()
        order = order[counts[0]:]
        rows = order // top_k
        x = hidden[rows]
        out = torch.empty_like(x)
        start = 0
        for expert, n in enumerate(counts[1:]):
            if n:
                seg = slice(start, start + n)
                out[seg] = F.linear(silu_and_mul(F.linear(x[seg], w13[expert])), w2[expert])
                start += n
        out *= tokens.topk_weights.flatten()[order].unsqueeze(1).to(out.dtype)
        # Unpermute into [token, slot] and sum the slots: a fixed summation order, and no
        # scatter-add (whose CPU kernel starts threads even for a handful of rows).
        per_slot = hidden.new_zeros(ids.shape[0], hidden.shape[1])
        per_slot[order] = out
        return per_slot.view(-1, top_k, hidden.shape[1]).sum(1)


class FusedMoE(nn.Module):
    """The routed experts of one MoE layer ("mlp.experts" in checkpoints)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, backend: str = "torch",
                 placement: ExpertPlacement | None = None, dispatcher: MoEDispatcher | None = None):
        super().__init__()
        self.placement = placement or ExpertPlacement.all_local(num_experts)
        assert self.placement.num_experts == num_experts
        self.dispatcher = dispatcher or LocalDispatcher(self.placement)
        self.backend = get_moe_backend(backend)()
        self.intermediate_size = intermediate_size
        e = self.placement.num_local
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(e, hidden_size, intermediate_size), requires_grad=False)
        self.w13_weight.weight_loader = self.w2_weight.weight_loader = self.weight_loader

    def expected_shards(self, param: nn.Parameter) -> set[tuple[int, str]]:
        """The shard ids a full load of `param` consists of: one per held expert and projection."""
        names = ("w1", "w3") if param is self.w13_weight else ("w2",)
        first = self.placement.first
        return {(e, n) for e in range(first, first + self.placement.num_local) for n in names}

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str]) -> None:
        expert, which = shard_id
        assert self.placement.holds(expert), f"expert {expert} is not held on this rank"
        local, i = expert - self.placement.first, self.intermediate_size
        if which == "w2":
            default_weight_loader(param.data[local], loaded)
        else:
            default_weight_loader(param.data[local].narrow(0, 0 if which == "w1" else i, i), loaded)

    def forward(self, hidden: torch.Tensor, routing: Routing, shared_experts: nn.Module | None = None) -> torch.Tensor:
        """[T, H]: the routed experts' weighted sum, plus the shared experts' output if given."""
        tokens = self.dispatcher.dispatch(hidden, routing)
        # Between dispatch and combine: where an all-to-all dispatcher overlaps the shared experts
        # with the transfer.
        shared = shared_experts(hidden) if shared_experts is not None else None
        out = self.dispatcher.combine(self.backend.apply(tokens, self.w13_weight, self.w2_weight), tokens)
        return out if shared is None else out + shared
