"""KV cache groups as the scheduler sees them (vLLM's KVCacheConfig / KVCacheGroupSpec, reduced to
integers): a model whose layers cache different things per token (DeepSeek-V4's sliding window and
its compressed entries at two ratios) keeps each kind in a group of its own, with its own pool of
blocks and its own block table per request. A model with one kind of cache has no KVCacheConfig
and the scheduler runs its one-group path.

It also owns the bounded-replay rule for prefix hits on such a model: which tokens before a hit
must be recomputed to rebuild what the window group did not keep, so that the hit stays exact.
This file never imports torch and never touches blocks (HybridKVCacheManager does).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroup:
    """One group: `num_blocks` blocks, each covering `block_size` tokens of the sequence (a
    compressed group's block holds block_size // ratio entries, so its block_size is a multiple of
    the engine's --block-size).

    `sliding_window` > 0: a request needs only its last `sliding_window` tokens before the next one
    to compute (window keys, a compressor's open group); blocks wholly behind them go back to the
    pool while the request runs, and the group is never prefix-cached (a hit replays it).
    `lookback`: tokens before its own span that an entry of a compressed group pools (CSA's
    overlap: one ratio; HCA: 0)."""
    name: str
    block_size: int
    num_blocks: int
    bytes_per_token: float          # what the group holds per token of the sequence (all layers)
    sliding_window: int = 0
    lookback: int = 0


@dataclass(frozen=True)
class KVCacheConfig:
    """The groups of one model's cache (the first is the sliding one, whose slots the step's slot
    mapping addresses), and what a replay must cover: `num_layers` stacked attention windows of
    `window` tokens each (the current one included)."""
    groups: tuple[KVCacheGroup, ...]
    window: int
    num_layers: int

    def __post_init__(self) -> None:
        assert self.groups and self.groups[0].sliding_window > 0, "the first group is the sliding one"
        assert all(g.sliding_window == 0 for g in self.groups[1:]), "one sliding group"

    def replay_start(self, hit_tokens: int, hit_blocks: list[int], block_size: int) -> int:
        """The first token a request must recompute when its compressed groups hit
        `hit_blocks[i]` blocks each (groups[1:]) and its prefix is known up to `hit_tokens`.

        A window layer's keys at t are exact only if its input at t is, which needs the layer below
        to have seen the `window - 1` tokens before t: exact keys over the last window before the
        hit need num_layers * (window - 1) recomputed tokens (one window is enough for one layer
        only). A compressed entry the replay writes must pool raw values of exact inputs too, so the
        replay also starts (num_layers - 1) * (window - 1) tokens before the first entry not held in
        a hit block (minus its lookback). Rounded down to a block; 0 means no saving."""
        depth = (self.window - 1) * self.num_layers
        start = hit_tokens - depth
        for group, n in zip(self.groups[1:], hit_blocks):
            start = min(start, n * group.block_size - group.lookback - depth + self.window - 1)
        return max(0, start // block_size * block_size)
