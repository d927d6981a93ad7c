"""The MoE layer (vLLM's FusedMoE): routed experts with stacked weights, cut at the seams that expert
parallelism needs: which experts this rank holds (ExpertPlacement) and moving tokens to the ranks
that hold their experts and back (MoEDispatcher; both in model/moe_dispatch.py), and the grouped
expert compute (MoEBackend, a registry by name).

Weights are stacked per layer: w13_weight [E_local, 2 * I_local, H] (each expert's gate_proj rows,
then its up_proj rows) and w2_weight [E_local, H, I_local] (down_proj); per-expert checkpoint
tensors load into them by (expert id, "w1" | "w3" | "w2"). How a layer splits over ranks
(ParallelGroups), as vLLM does it:
- one process: every expert, whole; dispatch and combine are the identity;
- tensor parallelism: every expert on every rank, its intermediate features split over `tp`
  (w13 by rows, w2 by columns, like an MLP's gate_up and down projections);
- expert parallelism (`groups.ep` larger than one): E / ep_size whole experts per rank, tokens
  moved by AllToAllDispatcher.
Either way each rank ends with a partial sum of the layer's output (its features' share, or its
TP share of the tokens), and one all-reduce over `tp` finishes the layer, shared experts included.
Every layer counts the tokens routed to each global expert for /metrics. This file must never
choose experts (model/gate.py does) nor know any architecture.
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from rackserve.distributed.parallel_state import ParallelGroups
from rackserve.model.layers import default_weight_loader, silu_and_mul, split_evenly
from rackserve.model.moe_dispatch import AllToAllDispatcher, DispatchedTokens, ExpertPlacement, LocalDispatcher
from rackserve.model.gate import Routing
from rackserve.registry import Registry

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


class MoEBackend(ABC):
    @abstractmethod
    def apply(self, tokens: DispatchedTokens, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """[N, H]: for each token, the sum over its experts held here of weight * expert(token)."""


# Backend "x" lives in x_moe.py.
MOE_BACKENDS: Registry[type[MoEBackend]] = Registry("MoE backend", "rackserve.model.{}_moe")
register_moe_backend, get_moe_backend = MOE_BACKENDS.register, MOE_BACKENDS.get


@register_moe_backend("torch")
class TorchMoEBackend(MoEBackend):
    """Sort the (token, expert) pairs by expert, one gate_up and one down matmul per active expert
    over its contiguous rows, scale by the routing weights, unsort and sum each token's pairs.
    `activation` (SiLU-and-mul) is what a model with another gated activation overrides."""

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)

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
                out[seg] = F.linear(self.activation(F.linear(x[seg], w13[expert])), w2[expert])
                start += n
        out *= tokens.topk_weights.flatten()[order].unsqueeze(1).to(out.dtype)
        # Unpermute into [token, slot] and sum the slots: a fixed summation order, and no
        # scatter-add (whose CPU kernel starts threads even for a handful of rows).
        per_slot = hidden.new_zeros(ids.shape[0], hidden.shape[1])
        per_slot[order] = out
        return per_slot.view(-1, top_k, hidden.shape[1]).sum(1)


class FusedMoE(nn.Module):
    """The routed experts of one MoE layer ("mlp.experts" in checkpoints). `placement` (one process
    only) holds a subset of the experts, for tests of the expert-parallel seam."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, backend: str = "torch",
                 groups: ParallelGroups | None = None, placement: ExpertPlacement | None = None):
        super().__init__()
        groups = groups or ParallelGroups.single()
        self.tp = groups.tp
        if groups.ep.world_size > 1:
            assert placement is None, "under expert parallelism the EP group places the experts"
            self.placement = ExpertPlacement.for_rank(num_experts, groups.ep.world_size, groups.ep.rank_in_group)
            self.dispatcher = AllToAllDispatcher(self.placement, groups.ep, groups.tp)
            # Whole experts: the TP ranks split the tokens instead (see AllToAllDispatcher).
            self.intermediate_held = (0, intermediate_size)
        else:
            self.placement = placement or ExpertPlacement.all_local(num_experts)
            self.dispatcher = LocalDispatcher(self.placement)
            self.intermediate_held = split_evenly(intermediate_size, self.tp.world_size, self.tp.rank_in_group)
        assert self.placement.num_experts == num_experts
        self.backend = get_moe_backend(backend)()
        e, i = self.placement.num_local, self.intermediate_held[1]
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(e, hidden_size, i), requires_grad=False)
        self.w13_weight.weight_loader = self.w2_weight.weight_loader = self.weight_loader
        # (token, chosen expert) pairs per global expert since the runner last took them.
        self.register_buffer("expert_token_counts", torch.zeros(num_experts, dtype=torch.int64), persistent=False)

    def expected_shards(self, param: nn.Parameter) -> set[tuple[int, str]]:
        """The shard ids a full load of `param` consists of: one per held expert and projection."""
        names = ("w1", "w3") if param is self.w13_weight else ("w2",)
        first = self.placement.first
        return {(e, n) for e in range(first, first + self.placement.num_local) for n in names}

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str]) -> None:
        expert, which = shard_id
        assert self.placement.holds(expert), f"expert {expert} is not held on this rank"
        local, (start, size) = expert - self.placement.first, self.intermediate_held
        if which == "w2":
            default_weight_loader(param.data[local], loaded.narrow(1, start, size))
        else:
            rows = param.data[local].narrow(0, 0 if which == "w1" else size, size)
            default_weight_loader(rows, loaded.narrow(0, start, size))

    def forward(self, hidden: torch.Tensor, routing: Routing, shared_experts: nn.Module | None = None) -> torch.Tensor:
        """[T, H]: the routed experts' weighted sum, plus the shared experts' output if given. Under
        TP, `shared_experts` must return its partial sum unreduced (its down projection split by
        input features, not all-reduced): the one all-reduce here covers both."""
        self.expert_token_counts += torch.bincount(routing.topk_ids.flatten(), minlength=self.placement.num_experts)
        tokens = self.dispatcher.dispatch(hidden, routing)
        # Between dispatch and combine: where an asynchronous all-to-all would overlap the
        # shared experts with the transfer.
        shared = shared_experts(hidden) if shared_experts is not None else None
        out = self.dispatcher.combine(self.backend.apply(tokens, self.w13_weight, self.w2_weight), tokens)
        return self.tp.all_reduce(out if shared is None else out + shared)


def take_expert_token_counts(moe_layers: list[FusedMoE]) -> list[int] | None:
    """(token, chosen expert) pairs per global expert since the last call, summed over the layers,
    whose counters restart at zero; None without MoE layers. Each rank counts the tokens of its
    own batch (the ranks of a TP group count the same ones)."""
    if not moe_layers:
        return None
    counts = torch.stack([m.expert_token_counts for m in moe_layers]).sum(0)
    for m in moe_layers:
        m.expert_token_counts.zero_()
    return counts.tolist()
