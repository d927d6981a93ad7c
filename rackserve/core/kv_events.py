"""KV cache events: what the BlockPool tells the outside world about its prefix cache.

One event per store (a run of blocks newly findable under their hashes), per eviction (a block
that loses its hash) and per reset (everything forgotten). The fields are vLLM's
(vllm/distributed/kv_events.py), so the engine can put them on the wire as they are and a
consumer can rebuild the cache's chains: a BlockStored names the parent of its first block and
carries the blocks' token ids. A model whose cache comes in several groups (DeepSeek-V4) sends
each prefix-cached group's events apart, with the group's index (`group_idx`) and its own block
size, as vLLM does for hybrid caches. This file owns these plain containers only: it never encodes,
sends or imports anything above core/.
"""
from __future__ import annotations

from dataclasses import dataclass

MEDIUM_GPU = "GPU"    # vLLM's name for the device tier (what the BlockPool holds), on CPU too


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]             # consecutive blocks of one chain, first to last
    parent_block_hash: int | None       # the block before the first one; None: a chain's start
    token_ids: list[int]                # len(block_hashes) * block_size tokens
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None        # the cache group (None: the model has one)


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
