"""Where a rank's KV cache blocks lie in memory, per cache group, for the connectors' worker halves.

Two layouts exist. A model with one kind of cache has one tensor `[layers, K/V or latent, blocks,
...]`: one group whose block is one range per (layer, tensor) plane. A model with several cache
groups (DeepSeek-V4: window, csa, hca; core/kv_cache_groups.py) has one tensor per group
`[blocks, slots, width]`: a block is one contiguous range. Both are described alike here (a group is
`num_planes` planes of `num_blocks` blocks of `plane_bytes` each), so a connector moves "block b of
group g" the same way for every model.

This file only computes addresses and views; it never decides what moves, nor copies values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GroupLayout:
    base: int          # address of the group's first byte
    num_blocks: int
    num_planes: int    # ranges a block is made of (layers x K/V for the one-tensor layout, else 1)
    plane_bytes: int   # bytes of one block in one plane

    @property
    def block_bytes(self) -> int:
        return self.num_planes * self.plane_bytes

    def plane_base(self, plane: int, base: int | None = None, num_blocks: int | None = None) -> int:
        """Address of `plane`'s first block (of a peer's group when base and num_blocks are given)."""
        return (self.base if base is None else base) + plane * (num_blocks or self.num_blocks) * self.plane_bytes

    def addresses(self, block_id: int) -> list[int]:
        """The block's range in each plane, in plane order."""
        return [self.plane_base(p) + block_id * self.plane_bytes for p in range(self.num_planes)]


class KVLayout:
    def __init__(self, kv_cache: Any):
        """`kv_cache`: the one-tensor cache, or the list of group tensors (several cache groups)."""
        self.tensors = list(kv_cache) if isinstance(kv_cache, (list, tuple)) else [kv_cache]
        self.grouped = isinstance(kv_cache, (list, tuple))
        for t in self.tensors:
            assert t.is_contiguous(), "addresses are computed over contiguous KV cache tensors"
        self.dtype = self.tensors[0].dtype
        self.groups = []
        for t in self.tensors:
            planes = 1 if self.grouped else t.shape[0] * t.shape[1]
            num_blocks = t.shape[0] if self.grouped else t.shape[2]
            self.groups.append(GroupLayout(t.data_ptr(), num_blocks, planes,
                                           t.numel() * t.element_size() // (planes * num_blocks)))

    def block(self, group: int, block_id: int) -> Any:
        """A view of one block of one group (its planes stacked first)."""
        t = self.tensors[group]
        return t[block_id] if self.grouped else t[:, :, block_id]

    def describe(self) -> list[list[int]]:
        """What must match between two ranks that exchange blocks: each group's planes and sizes."""
        return [[g.num_planes, g.plane_bytes] for g in self.groups]

    def ranges(self, group: int, local_ids: list[int], remote_ids: list[int], remote_base: int,
               remote_num_blocks: int) -> tuple[list[int], list[int], list[int]]:
        """(local address, remote address, bytes) to copy blocks `remote_ids` of a peer's group
        (same layout) into `local_ids`: one range per plane and run of consecutive ids on both sides."""
        runs: list[list[int]] = []   # [local first, remote first, count]
        for lb, rb in zip(local_ids, remote_ids, strict=True):
            if runs and lb == runs[-1][0] + runs[-1][2] and rb == runs[-1][1] + runs[-1][2]:
                runs[-1][2] += 1
            else:
                runs.append([lb, rb, 1])
        g = self.groups[group]
        local, remote, lengths = [], [], []
        for plane in range(g.num_planes):
            here, there = g.plane_base(plane), g.plane_base(plane, remote_base, remote_num_blocks)
            for lb, rb, count in runs:
                local.append(here + lb * g.plane_bytes)
                remote.append(there + rb * g.plane_bytes)
                lengths.append(count * g.plane_bytes)
        return local, remote, lengths
