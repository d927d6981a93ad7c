"""Where the routed experts of an MoE layer live and how tokens reach them: ExpertPlacement (the
global experts one rank holds) and the MoEDispatcher seam (dispatch each token to the ranks
holding its chosen experts, combine their results back), in two forms: LocalDispatcher (every
expert here: the identity) and AllToAllDispatcher (expert parallelism over a group of ranks).

This file must never compute experts (model/moe.py's backends do) nor choose them
(model/gate.py does), and never assume that the ranks of the expert-parallel group hold the
same tokens: under data parallelism each has its own batch.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from rackserve.distributed.parallel_state import GroupCoordinator
from rackserve.model.layers import split_evenly
from rackserve.model.gate import Routing


@dataclass(frozen=True)
class ExpertPlacement:
    """The experts this rank holds: global ids [first, first + num_local) of num_experts."""
    num_experts: int
    first: int
    num_local: int

    @classmethod
    def all_local(cls, num_experts: int) -> "ExpertPlacement":
        return cls(num_experts, 0, num_experts)

    @classmethod
    def for_rank(cls, num_experts: int, ep_size: int, ep_rank: int) -> "ExpertPlacement":
        """Rank `ep_rank`'s share of an expert-parallel group of `ep_size`: equal contiguous ranges."""
        if num_experts % ep_size:
            raise ValueError(f"expert parallelism needs the {num_experts} routed experts to split evenly over "
                             f"the {ep_size} ranks of the expert-parallel group (data_parallel_size x "
                             f"tensor_parallel_size); choose sizes whose product divides {num_experts}, or run "
                             "without --enable-expert-parallel")
        per_rank = num_experts // ep_size
        return cls(num_experts, ep_rank * per_rank, per_rank)

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
        """Send each token of hidden [T, H] to the ranks holding its chosen experts."""

    @abstractmethod
    def combine(self, expert_out: torch.Tensor, tokens: DispatchedTokens) -> torch.Tensor:
        """expert_out [N, H], each dispatched token's weighted expert sum on this rank, back to
        [T, H]: each token's sum over the ranks that computed it. Rows of tokens this rank did
        not dispatch are zero; another rank of its TP group dispatched them, and the layer's
        all-reduce over TP adds them in."""


class LocalDispatcher(MoEDispatcher):
    """Every expert of this rank's tokens is computed here: the identity."""

    def __init__(self, placement: ExpertPlacement):
        self.placement = placement

    def dispatch(self, hidden: torch.Tensor, routing: Routing) -> DispatchedTokens:
        return DispatchedTokens(hidden, self.placement.to_local(routing.topk_ids), routing.topk_weights, None)

    def combine(self, expert_out: torch.Tensor, tokens: DispatchedTokens) -> torch.Tensor:
        return expert_out


class _Sent(NamedTuple):
    """AllToAllDispatcher's handle: where the rows it sent came from."""
    num_tokens: int                     # T, rows of the layer's input
    rows: slice                         # the input rows this rank dispatched (its TP share)
    token_of_row: torch.Tensor          # [S] index into `rows` of each row sent, in send order
    send_counts: list[int]              # rows sent to each rank of the EP group
    recv_counts: list[int]              # rows received from each


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 2-D tensor's rows as raw bytes, [S, row bytes] uint8."""
    return t.contiguous().view(torch.uint8)


class AllToAllDispatcher(MoEDispatcher):
    """Expert parallelism over `ep`: each rank holds an equal contiguous range of the experts. A
    token goes once to every rank holding one of its chosen experts (two experts on one rank: one
    copy), with its top-k ids and weights; that rank sums its experts' weighted outputs, and
    combine sends the sums back, where each token adds up its ranks' sums.

    Three all-to-alls per layer: the row counts (every rank must size what it receives; under
    data parallelism no rank can infer another's batch), the rows (hidden state, ids and weights
    as the bytes of one message, one latency instead of three), and the results. The ranks of a TP
    group hold the same tokens, so each dispatches only its contiguous share (split_evenly over
    `tp`): no token is sent twice, and the packing and the traffic spread over the TP ranks'
    links. combine leaves the other shares' rows zero; the all-reduce over TP that the layer
    runs anyway for its TP-split shared experts completes them."""

    def __init__(self, placement: ExpertPlacement, ep: GroupCoordinator, tp: GroupCoordinator):
        assert placement.num_local * ep.world_size == placement.num_experts, "experts split unevenly over ep"
        self.placement, self.ep, self.tp = placement, ep, tp

    def dispatch(self, hidden: torch.Tensor, routing: Routing) -> DispatchedTokens:
        start, n = split_evenly(hidden.shape[0], self.tp.world_size, self.tp.rank_in_group)
        rows = slice(start, start + n)
        ids, weights = routing.topk_ids[rows], routing.topk_weights[rows]
        size = self.ep.world_size
        visits = torch.zeros(n, size, dtype=torch.bool, device=hidden.device)
        visits.scatter_(1, ids // self.placement.num_local, True)
        # Row-major over [rank, token]: rank 0's rows first, each rank's in token order.
        token_of_row = visits.t().nonzero(as_tuple=True)[1]
        send = visits.sum(0)
        recv = self.ep.all_to_all(send, [1] * size, [1] * size)
        send_counts, recv_counts = send.tolist(), recv.tolist()
        parts = (hidden[rows][token_of_row], ids[token_of_row], weights[token_of_row])
        got = self.ep.all_to_all(torch.cat([_as_bytes(p) for p in parts], dim=1), recv_counts, send_counts)
        widths = [p.shape[1] * p.element_size() for p in parts]
        x, got_ids, got_weights = (b.contiguous().view(p.dtype) for b, p in zip(got.split(widths, dim=1), parts))
        sent = _Sent(hidden.shape[0], rows, token_of_row, send_counts, recv_counts)
        return DispatchedTokens(x, self.placement.to_local(got_ids), got_weights, sent)

    def combine(self, expert_out: torch.Tensor, tokens: DispatchedTokens) -> torch.Tensor:
        sent: _Sent = tokens.handle
        back = self.ep.all_to_all(expert_out, sent.send_counts, sent.recv_counts)
        out = expert_out.new_zeros(sent.num_tokens, expert_out.shape[1])
        # A token's sums arrive in rank order and add up in that order: a fixed summation order.
        out[sent.rows].index_add_(0, sent.token_of_row, back)
        return out
