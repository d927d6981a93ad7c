"""The KV cache of a model with several cache groups (DeepSeek-V4): how many blocks each group gets
out of --kv-cache-memory, one zeroed tensor per group [num_blocks, slots_per_block, width], bound to
the model's layers, and the KVCacheConfig the scheduler plans with.

The sliding group gets what the busiest step can hold (every running request's window plus the
step's tokens); the compressed groups share the rest so that each holds as many tokens as the
others. --num-gpu-blocks-override gives every group that many blocks. This file must never decide
what runs, nor read or write a cache's values.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from rackserve.config import EngineConfig
from rackserve.core.kv_cache_groups import KVCacheConfig
from rackserve.distributed.parallel_state import GroupCoordinator
from rackserve.kv_transfer.base import check_kv_cache_groups

logger = logging.getLogger(__name__)


def allocate_kv_cache_groups(model: nn.Module, config: EngineConfig, dtype: torch.dtype,
                             tp: GroupCoordinator) -> tuple[KVCacheConfig, list[torch.Tensor]]:
    check_kv_cache_groups(config)   # before any connector half meets the group tensors
    cache, block_size = config.cache, config.cache.block_size
    groups = model.kv_cache_groups(block_size)
    if cache.num_gpu_blocks_override is not None:
        counts = [cache.num_gpu_blocks_override] * len(groups.groups)
    else:
        window = groups.window_blocks_needed(config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens)
        counts = groups.num_blocks(int(cache.kv_cache_memory_gib * 2**30), dtype.itemsize, window)
    # The cache is replicated over TP ranks: they must index the same blocks.
    counts = [tp.min(n) for n in counts]
    # Zeroed: padded decode rows and replayed tokens read stale slots (masked, or discarded).
    tensors = [torch.zeros(n, g.slots_per_block, g.width, dtype=dtype, device=config.model.device)
               for g, n in zip(groups.groups, counts)]
    model.bind_kv_cache_groups(groups, tensors)
    kv_config = groups.kv_cache_config(counts, dtype.itemsize, len(groups.layers))
    logger.info("KV cache groups: %s", describe(kv_config))
    return kv_config, tensors


def describe(kv_config: KVCacheConfig) -> str:
    """One line: each group's bytes per token, blocks and tokens per block."""
    return "; ".join(
        f"{g.name}: {g.bytes_per_token:g} B/token{' (last %d tokens kept)' % g.sliding_window if g.sliding_window else ''}"
        f", {g.num_blocks} blocks of {g.block_size} tokens" for g in kv_config.groups)
