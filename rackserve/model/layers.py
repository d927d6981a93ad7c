"""Building blocks shared by the decoder models: norms, linears, embedding, lm_head, activation, and
their tensor-parallel forms.

Each weight-bearing layer is a small class whose parameters carry a `weight_loader(param, loaded,
shard_id)`, so that checkpoints written with separate q/k/v or gate/up tensors load into our fused
layers, and so that tensor parallelism is local: a parallel layer takes its group (`tp`, a
GroupCoordinator; a group of one by default), keeps only its slice of each checkpoint tensor in
its loader, and communicates in its forward. Slices are contiguous and as even as they go, so a
size that the group does not divide (SmolLM2's 3 KV heads on 2 ranks) is split 2 + 1 rather than
refused. This file must never know about the KV cache, attention metadata or any particular
architecture.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from rackserve.distributed.parallel_state import GroupCoordinator
from rackserve.model import native_ops
from rackserve.model.quant.quantized_weight import QuantizedWeight

SINGLE = GroupCoordinator.single()
# Logits a quantized lm_head recomputes exactly per row: more than the 20 top logprobs an API asks.
EXACT_TOP_LOGITS = 32


def _param(*shape: int) -> nn.Parameter:
    # Uninitialised on purpose: every parameter is overwritten by the checkpoint, and random
    # initialisation of a large model would cost seconds.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    assert param.shape == loaded.shape, f"shape mismatch: param {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}"
    param.data.copy_(loaded)


def split_evenly(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of part `index` of `total` items cut into `parts` contiguous parts whose sizes
    differ by at most one, the larger ones first."""
    base, extra = divmod(total, parts)
    return index * base + min(index, extra), base + (index < extra)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = _param(hidden_size)
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with a residual (vLLM's form), (norm(x + residual), x + residual), where the
        native op adds into `residual` (the caller's own) in place. Computed in float32 and cast
        back before the weight, as transformers does (so bf16 matches it exactly); float32 CPU
        rows take one native call (native_ops.py) instead of six ops."""
        out, summed = native_ops.add_rms_norm(x, residual, self.weight, self.eps)
        return out if residual is None else (out, summed)


class Linear(QuantizedWeight, nn.Module):
    """y = x W^T (+ b), W of shape [output_size, input_size], loaded whole (replicated on every rank)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = _param(output_size, input_size)
        self.weight.weight_loader = self.weight_loader
        self.bias = _param(output_size) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def weight_slice(self, shard_id: object) -> tuple[int, int, int, int, int]:
        assert shard_id is None, f"{type(self).__name__} takes no shards"
        return 0, 0, self.output_size, 0, self.input_size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        assert shard_id is None, f"{type(self).__name__} takes no shards"
        default_weight_loader(param, loaded)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T, on the packed weight when it stayed quantized."""
        return native_ops.linear(x, self.weight) if self.quant is None else self.quant(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            return native_ops.linear(x, self.weight, self.bias)
        y = self.quant(x)
        return y if self.bias is None else y + self.bias


class Held(NamedTuple):
    """The rows of one checkpoint tensor that this rank holds."""
    full_size: int      # rows of the checkpoint tensor
    start: int          # the first row held
    size: int           # rows held


class ColumnParallelLinear(Linear):
    """W split by output rows over `tp`: each rank computes its slice of the output features and
    nothing is communicated (the RowParallelLinear after it consumes exactly that slice).

    `output_size` is the whole layer's; subclasses that fuse several checkpoint tensors along the
    output pass `held`, one entry per tensor, and name them by shard id in the loader."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: GroupCoordinator = SINGLE,
                 held: list[Held] | None = None):
        held = held or [Held(output_size, *split_evenly(output_size, tp.world_size, tp.rank_in_group))]
        assert sum(h.full_size for h in held) == output_size
        super().__init__(input_size, sum(h.size for h in held), bias)
        self.tp, self.held = tp, held
        self.shard_offsets = [sum(h.size for h in held[:i]) for i in range(len(held))]

    def shard_index(self, shard_id: object) -> int:
        assert shard_id is None, f"{type(self).__name__} takes no shards"
        return 0

    def weight_slice(self, shard_id: object) -> tuple[int, int, int, int, int]:
        i = self.shard_index(shard_id)
        return self.shard_offsets[i], self.held[i].start, self.held[i].size, 0, self.input_size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        dst, src, rows, _, _ = self.weight_slice(shard_id)
        full = self.held[self.shard_index(shard_id)].full_size
        assert loaded.shape[0] == full, f"shard {shard_id}: {loaded.shape[0]} rows, expected {full}"
        default_weight_loader(param.data.narrow(0, dst, rows), loaded.narrow(0, src, rows))


class MergedLinear(ColumnParallelLinear):
    """Several linears of one input concatenated along the output (gate_proj + up_proj): one GEMM
    instead of several. Shard i of the checkpoint is split over `tp` on its own, so each rank
    holds a matching slice of every shard (its gate rows pair with its up rows)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, tp: GroupCoordinator = SINGLE):
        held = [Held(n, *split_evenly(n, tp.world_size, tp.rank_in_group)) for n in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, tp, held)

    def shard_index(self, shard_id: object) -> int:
        assert isinstance(shard_id, int), "MergedLinear loads one shard at a time"
        return shard_id


class HeadPartition(NamedTuple):
    """The attention heads one rank computes: query heads [q_start, q_start + num_heads) and KV
    heads [kv_start, kv_start + num_kv_heads) of the checkpoint."""
    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def head_partition(num_heads: int, num_kv_heads: int, size: int, rank: int) -> HeadPartition:
    """Rank `rank` of `size` takes whole KV groups (a KV head with its query heads), as evenly as
    they go. With more ranks than KV heads each KV head is replicated on size / num_kv_heads ranks,
    which split its query heads, as vLLM does."""
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    per_group = num_heads // num_kv_heads
    if size <= num_kv_heads:
        group_start, groups = split_evenly(num_kv_heads, size, rank)
        return HeadPartition(group_start * per_group, groups * per_group, group_start, groups)
    if size % num_kv_heads or num_heads % size:
        raise ValueError(f"tensor_parallel_size={size} exceeds the {num_kv_heads} KV heads, so it must be a "
                         f"multiple of them and divide the {num_heads} query heads")
    q_per_rank = num_heads // size
    return HeadPartition(rank * q_per_rank, q_per_rank, rank // (size // num_kv_heads), 1)


class QKVLinear(ColumnParallelLinear):
    """q_proj, k_proj and v_proj fused; shards are named "q", "k", "v". Split over `tp` by
    head_partition; `num_heads`, `num_kv_heads`, `q_size` and `kv_size` are this rank's."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 tp: GroupCoordinator = SINGLE):
        part = head_partition(num_heads, num_kv_heads, tp.world_size, tp.rank_in_group)
        q_full, kv_full = num_heads * head_dim, num_kv_heads * head_dim
        kv = Held(kv_full, part.kv_start * head_dim, part.num_kv_heads * head_dim)
        held = [Held(q_full, part.q_start * head_dim, part.num_heads * head_dim), kv, kv]
        super().__init__(hidden_size, q_full + 2 * kv_full, bias, tp, held)
        self.partition = part
        self.num_heads, self.num_kv_heads = part.num_heads, part.num_kv_heads
        self.q_size, self.kv_size = part.num_heads * head_dim, part.num_kv_heads * head_dim

    def shard_index(self, shard_id: object) -> int:
        assert shard_id in ("q", "k", "v"), f"QKVLinear shard must be q, k or v, got {shard_id!r}"
        return "qkv".index(shard_id)


class RowParallelLinear(Linear):
    """W split by input columns over `tp`: each rank multiplies its slice of the input features
    (the column-parallel layer before it produced exactly those), and the partial outputs are
    summed by an all-reduce; the bias is added once, after it. `input_held` = (start, size) of the
    input features this rank holds; default an even split."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: GroupCoordinator = SINGLE,
                 input_held: tuple[int, int] | None = None):
        start, size = input_held or split_evenly(input_size, tp.world_size, tp.rank_in_group)
        super().__init__(size, output_size, bias)
        self.tp, self.input_start, self.full_input_size = tp, start, input_size

    def weight_slice(self, shard_id: object) -> tuple[int, int, int, int, int]:
        assert shard_id is None, f"{type(self).__name__} takes no shards"
        return 0, 0, self.output_size, self.input_start, self.input_size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        assert shard_id is None, f"{type(self).__name__} takes no shards"
        if param is self.weight:
            assert loaded.shape[1] == self.full_input_size, \
                f"{loaded.shape[1]} input columns, expected {self.full_input_size}"
            loaded = loaded.narrow(1, self.input_start, self.input_size)
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return super().forward(x)
        y = self.tp.all_reduce(self.matmul(x))
        return y if self.bias is None else y + self.bias


def _vocab_rows(vocab_size: int, tp: GroupCoordinator) -> tuple[int, int, int]:
    """(first id, ids held, rows allocated) of this rank's vocabulary slice: the vocabulary is
    padded up to a multiple of the group size so that every rank's logits have one width."""
    rows = -(-vocab_size // tp.world_size)
    start = tp.rank_in_group * rows
    return start, max(0, min(rows, vocab_size - start)), rows


class VocabEmbedding(QuantizedWeight, nn.Module):
    """Token embedding with the vocabulary split over `tp` (vLLM's VocabParallelEmbedding): each
    rank looks up the ids in its slice, zeroes the rows of the others, and the all-reduce leaves
    each token the one row that was not zero."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: GroupCoordinator = SINGLE):
        super().__init__()
        self.vocab_size, self.tp = vocab_size, tp
        self.vocab_start, self.num_held, rows = _vocab_rows(vocab_size, tp)
        self.weight = _param(rows, hidden_size)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        assert shard_id is None, f"{type(self).__name__} takes no shards"
        assert loaded.shape[0] == self.vocab_size, f"{loaded.shape[0]} rows, expected {self.vocab_size}"
        default_weight_loader(param.data[:self.num_held], loaded.narrow(0, self.vocab_start, self.num_held))
        param.data[self.num_held:].zero_()   # padding rows: logits there are cut off, but never NaN

    def weight_slice(self, shard_id: object) -> tuple[int, int, int, int, int]:
        assert shard_id is None, f"{type(self).__name__} takes no shards"
        return 0, self.vocab_start, self.num_held, 0, self.weight.shape[1]

    def _dense_rows(self) -> int:
        return self.num_held

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_held)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(h.masked_fill_(outside.unsqueeze(-1), 0.0))


class LMHead(VocabEmbedding):
    """Hidden states to logits (vLLM's ParallelLMHead); shares the embedding's weight when the
    checkpoint ties them. Under `tp` each rank computes the logits of its vocabulary slice and an
    all-gather gives every rank all of them, so that every rank samples the same token."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_embedding: VocabEmbedding | None = None,
                 tp: GroupCoordinator = SINGLE):
        super().__init__(vocab_size, hidden_size, tp)
        if tied_embedding is not None:
            assert tied_embedding.tp == tp, "a tied lm_head splits like its embedding"
            self.weight = self.tied_weight = tied_embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = native_ops.linear(hidden, self.weight) if self.quant is None else self.quant(hidden, EXACT_TOP_LOGITS)
        if self.tp.world_size == 1:
            return logits
        return self.tp.all_gather(logits, dim=-1)[:, :self.vocab_size]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return native_ops.silu_and_mul(gate_up)
