"""Process groups of one instance's ranks (GroupCoordinator, ParallelGroups) and the collectives the
parallel layers and the workers call. Every collective is the identity on a group of one, so a
single process runs the same code with no torch.distributed at all.

Groups are values handed down explicitly (worker -> ModelRunner -> model -> layers), never looked
up in a module-level registry: a layer's constructor says which group it splits over. The only
global state is torch.distributed's own default group, created once per worker process by
`init_distributed`. This file must never know about models, requests or the engine.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rackserve.config import ParallelConfig, free_port_run

# Within a forward pass a rank waits on a peer for at most one layer's imbalance; a collective
# stuck this long means a peer hangs (a dead peer closes its sockets and fails at once).
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
# Ranks wait for the next step in a control-group broadcast: an idle server legitimately waits
# there for days.
CONTROL_TIMEOUT = timedelta(days=365)
# Node 0 waits this long for the other machines' workers to join.
RENDEZVOUS_TIMEOUT = timedelta(minutes=10)
# Below this size a CPU all-reduce is an all-gather and a local sum (see GroupCoordinator.all_reduce).
SMALL_ALL_REDUCE_BYTES = 256 * 2**10
# torch 2.13 renamed all_gather_into_tensor (and warns on the old name); older versions lack the new one.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class CollectiveTimer:
    """Wall time a rank spends inside collectives, waiting for its peers included: a benchmark's
    instrument (serving runs without one). On CUDA it sees only the launch of an NCCL call
    unless the caller synchronises."""
    seconds: float = 0.0
    calls: int = 0


@dataclass(frozen=True)
class GroupCoordinator:
    """One group of ranks (vLLM's name): tensors go over `device_group` (nccl on CUDA, gloo on
    CPU), picklable objects over `cpu_group` (always gloo). Both are None for a group of one."""
    ranks: tuple[int, ...]                      # global ranks, in group order
    rank_in_group: int
    device_group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None
    timer: CollectiveTimer | None = None

    def __post_init__(self) -> None:
        assert 0 <= self.rank_in_group < len(self.ranks)
        assert (self.device_group is None) == (len(self.ranks) == 1), "a group of one needs no process group"

    @classmethod
    def single(cls) -> "GroupCoordinator":
        return cls((0,), 0)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    def _timed(self, start: float) -> None:
        if self.timer is not None:
            self.timer.seconds += time.perf_counter() - start
            self.timer.calls += 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place; returns x."""
        if self.world_size > 1:
            start = time.perf_counter()
            if x.device.type == "cpu" and x.numel() * x.element_size() <= SMALL_ALL_REDUCE_BYTES:
                # gloo's all_reduce has a multi-millisecond tail on small CPU tensors (at 2 KB:
                # mean 0.7-1.5 ms against 0.2-0.4 ms for all_gather): gather and add up instead,
                # in rank order on every rank, so all ranks hold the same bits.
                parts = x.new_empty(self.world_size * x.numel())
                _all_gather_single(parts, x.reshape(-1), group=self.device_group)
                torch.sum(parts.view(self.world_size, *x.shape), dim=0, out=x)
            else:
                dist.all_reduce(x, group=self.device_group)
            self._timed(start)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x concatenated along dim, in group order; all ranks' x have one shape."""
        if self.world_size == 1:
            return x
        # Into one tensor (ranks stacked along dim 0): gloo is faster so than into a list of
        # tensors for large messages (8 MB per rank: ~16 ms against ~22 ms here).
        start = time.perf_counter()
        out = x.new_empty((self.world_size * x.shape[0], *x.shape[1:]))
        _all_gather_single(out, x.contiguous(), group=self.device_group)
        gathered = torch.cat(out.view(self.world_size, *x.shape).unbind(0), dim=dim)
        self._timed(start)
        return gathered

    def all_to_all(self, x: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int]) -> torch.Tensor:
        """x's rows in runs of input_split_sizes[r] rows, run r sent to the group's rank r; returns
        the rows received, output_split_sizes[r] of them from rank r, in group order. Every rank
        must know what it will receive (exchange the counts first, with equal splits of one)."""
        if self.world_size == 1:
            assert output_split_sizes == input_split_sizes == [x.shape[0]]
            return x
        start = time.perf_counter()
        out = x.new_empty((sum(output_split_sizes), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes, input_split_sizes, group=self.device_group)
        self._timed(start)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """The object of the rank_in_group `src`, on every rank (others pass anything)."""
        if self.world_size == 1:
            return obj
        start = time.perf_counter()
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.cpu_group)
        self._timed(start)
        return box[0]

    def gather_object(self, obj: Any) -> list[Any] | None:
        """Every rank's object, in group order, on the group's first rank; None on the others."""
        if self.world_size == 1:
            return [obj]
        box: list[Any] | None = [None] * self.world_size if self.is_first_rank else None
        dist.gather_object(obj, box, dst=self.ranks[0], group=self.cpu_group)
        return box

    def min(self, value: int) -> int:
        """The smallest of the ranks' integers."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


@dataclass(frozen=True)
class ParallelGroups:
    """The groups one rank belongs to; a model takes this and hands each layer the group it splits
    over: `tp` within one DP rank, `ep` across all of them.

    `dp` (vLLM's DP group) holds the ranks with this rank's TP index in every DP rank: its
    rank_in_group is this rank's DP rank, and the DP group of TP index 0 links the DP ranks' first
    ranks (the workers gather each step's outputs over it). No forward pass uses it."""
    world: GroupCoordinator
    tp: GroupCoordinator
    dp: GroupCoordinator = field(default_factory=GroupCoordinator.single)
    # The ranks whose MoE layers share out the experts (--enable-expert-parallel): every rank of the
    # instance (DP x TP); a group of one without expert parallelism.
    ep: GroupCoordinator = field(default_factory=GroupCoordinator.single)

    @classmethod
    def single(cls) -> "ParallelGroups":
        one = GroupCoordinator.single()
        return cls(world=one, tp=one, dp=one, ep=one)


def init_distributed(parallel: ParallelConfig, rank: int, timer: CollectiveTimer | None = None) -> ParallelGroups:
    """Join the instance's process group as `rank` (blocks until every rank has joined, up to
    RENDEZVOUS_TIMEOUT) and build this rank's groups, all of them reporting to `timer` if given.
    Once per process; CUDA ranks must have called torch.cuda.set_device first."""
    world_size = parallel.world_size
    assert parallel.master_port is not None, "the rendezvous port must be fixed before workers start"
    assert 0 <= rank < world_size
    store = dist.TCPStore(parallel.master_addr, parallel.master_port, world_size, is_master=rank == 0,
                          timeout=RENDEZVOUS_TIMEOUT)
    dist.init_process_group(parallel.distributed_backend, store=store, rank=rank, world_size=world_size,
                            timeout=COLLECTIVE_TIMEOUT)
    world = GroupCoordinator(tuple(range(world_size)), rank, dist.group.WORLD,
                             dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT), timer)
    tp_size = parallel.tensor_parallel_size
    tp = _subgroup(world, [list(range(s, s + tp_size)) for s in range(0, world_size, tp_size)])
    dp = _subgroup(world, [list(range(t, world_size, tp_size)) for t in range(tp_size)])
    ep = _subgroup(world, [list(range(world_size))] if parallel.enable_expert_parallel else
                   [[r] for r in range(world_size)])
    return ParallelGroups(world=world, tp=tp, dp=dp, ep=ep)


def _subgroup(world: GroupCoordinator, partition: list[list[int]]) -> GroupCoordinator:
    """This rank's group among `partition` (disjoint lists of ranks covering the world). Every rank
    must call this with the same partition: creating a group is itself a collective."""
    rank = world.ranks[world.rank_in_group]
    if len(partition) == 1:
        return world
    mine = None
    for ranks in partition:
        groups = (None, None) if len(ranks) == 1 else \
            (dist.new_group(ranks), dist.new_group(ranks, backend="gloo", timeout=CONTROL_TIMEOUT))
        if rank in ranks:
            mine = GroupCoordinator(tuple(ranks), ranks.index(rank), *groups, world.timer)
    assert mine is not None, f"rank {rank} is in no group of {partition}"
    return mine


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on `host`, from below the ephemeral range (config.free_port_run: the
    connections opened meanwhile never take it; another process binding ports may still)."""
    return free_port_run(host, 1)
