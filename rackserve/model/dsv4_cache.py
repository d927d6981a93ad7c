"""DeepSeek-V4's KV cache groups: what each layer kind caches, in which group, at which channels.

Three groups, each one paged tensor [num_blocks, slots_per_block, width] shared by its layers
(each layer owns a channel range of the width):
- "window" (a sliding group, one slot per token): every layer's window key; compressed layers add
  their compressor's raw kv and gate (its partial-group state), CSA layers the indexer's too. A
  request keeps only the tokens the next one needs: the window and the open compression groups.
- "csa" (one slot per entry of `ratio` tokens): each CSA layer's pooled entry and indexer key.
- "hca" (one slot per entry of its ratio): each HCA layer's pooled entry.
A compressed group's block holds lcm(block_size, ratio) // ratio entries, so that it covers whole
engine blocks and is named by their hashes (core/hybrid_kv_cache_manager.py).
This file must never touch a cache tensor's values (the backend does) nor decide what runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rackserve.core.kv_cache_groups import KVCacheConfig, KVCacheGroup
from rackserve.model.dsv4_attention import CSA, HCA, SLIDING, compress_ratio, layer_kinds

WINDOW_PARTS = ("window", "raw_kv", "raw_gate", "index_raw_kv", "index_raw_gate")
ENTRY_PARTS = ("entry", "index_entry")


@dataclass(frozen=True)
class LayerCache:
    """Where one layer's values live: channel ranges in the window group and in its kind's group
    (`group`: index in DSV4CacheGroups.groups, 0 for a sliding layer)."""
    group: int
    ranges: dict[str, tuple[int, int]]


@dataclass(frozen=True)
class CacheGroupShape:
    name: str
    tokens_per_block: int
    slots_per_block: int
    width: int                  # values per slot, all its layers together
    ratio: int = 1              # tokens per slot
    sliding_window: int = 0     # tokens kept before the next one (the window group)
    lookback: int = 0           # an entry also pools this many tokens before its own (CSA's overlap)


class DSV4CacheGroups:
    """The groups of one model (all layers, every TP rank alike: the cache is replicated)."""

    def __init__(self, config: dict[str, Any], block_size: int):
        kinds = layer_kinds(config)
        hd, idx = config["head_dim"], config.get("index_head_dim", 128)
        self.window = config["sliding_window"]
        sizes = {SLIDING: {"window": hd},
                 HCA: {"window": hd, "raw_kv": hd, "raw_gate": hd},
                 CSA: {"window": hd, "raw_kv": 2 * hd, "raw_gate": 2 * hd,
                       "index_raw_kv": 2 * idx, "index_raw_gate": 2 * idx}}
        entry_sizes = {HCA: {"entry": hd}, CSA: {"entry": hd, "index_entry": idx}}
        names = {CSA: "csa", HCA: "hca"}
        compressed = [k for k in (CSA, HCA) if k in kinds]
        widths = [0] * (1 + len(compressed))
        self.layers: list[LayerCache] = []
        for kind in kinds:
            ranges = {}
            for part, size in sizes[kind].items():
                ranges[part] = (widths[0], widths[0] + size)
                widths[0] += size
            group = 0 if kind == SLIDING else 1 + compressed.index(kind)
            for part, size in entry_sizes.get(kind, {}).items():
                ranges[part] = (widths[group], widths[group] + size)
                widths[group] += size
            self.layers.append(LayerCache(group, ranges))
        keep = self.window - 1
        shapes = []
        for kind in compressed:
            r = compress_ratio(config, kind)
            lookback = r if kind == CSA else 0
            keep = max(keep, r - 1 + lookback)     # the open group and, for CSA, the one before it
            tpb = math.lcm(block_size, r)
            shapes.append(CacheGroupShape(names[kind], tpb, tpb // r, widths[1 + len(shapes)], r, 0, lookback))
        self.groups = [CacheGroupShape("window", block_size, block_size, widths[0], 1, keep)] + shapes

    def window_blocks_needed(self, max_num_seqs: int, max_num_batched_tokens: int) -> int:
        """Window blocks that the busiest step can hold: every request's kept tokens plus the
        step's new ones, each request's span rounded out by a block at either end."""
        bs = self.groups[0].tokens_per_block
        return max_num_seqs * (-(-self.groups[0].sliding_window // bs) + 2) + -(-max_num_batched_tokens // bs)

    def bytes_per_token(self, itemsize: int) -> dict[str, float]:
        """Per group, bytes a token of the sequence costs (all layers): the window group's only
        for the tokens it keeps, a compressed group's for every token (one slot per `ratio`)."""
        return {g.name: g.width * itemsize / g.ratio for g in self.groups}

    def kv_cache_config(self, num_blocks: list[int], itemsize: int, num_layers: int) -> KVCacheConfig:
        per_token = self.bytes_per_token(itemsize)
        return KVCacheConfig(tuple(KVCacheGroup(g.name, g.tokens_per_block, n, per_token[g.name], g.sliding_window,
                                                g.lookback) for g, n in zip(self.groups, num_blocks)),
                             self.window, num_layers)

    def num_blocks(self, memory_bytes: int, itemsize: int, window_blocks: int) -> list[int]:
        """Blocks per group out of `memory_bytes`: the window group gets `window_blocks`, the
        compressed groups split the rest so that each holds the same number of tokens."""
        block_bytes = [g.slots_per_block * g.width * itemsize for g in self.groups]
        rest = memory_bytes - window_blocks * block_bytes[0]
        per_token = sum(b / g.tokens_per_block for g, b in zip(self.groups[1:], block_bytes[1:]))
        tokens = int(rest / per_token) if per_token else 0
        counts = [window_blocks] + [tokens // g.tokens_per_block for g in self.groups[1:]]
        if rest <= 0 or min(counts) < 1:
            raise ValueError(f"kv_cache_memory={memory_bytes / 2**30:.3g} GiB cannot hold the window blocks "
                             f"({window_blocks} x {block_bytes[0]} bytes) and a block of every compressed group")
        return counts
