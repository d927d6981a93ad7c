"""Block hashing: the one scheme by which the prefix cache, the simulator and the benchmarks name
a block of tokens (and by which KV events, the router's index and the KV pool will, once they
exist), so a hit means the same thing everywhere.

A block's hash chains its parent's hash, its token ids and optional extra keys (a cache salt), so
equal hashes mean equal whole prefixes. Hashes are 64-bit ints from BLAKE2b: stable across
processes and machines (never Python's `hash()`), and seedable so that two deployments can keep
disjoint namespaces. This file must never import torch.
"""
from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from hashlib import blake2b

BlockHash = int


def root_hash(seed: int = 0) -> BlockHash:
    """The parent hash of a sequence's first block."""
    return _digest(b"rackserve-root:" + str(seed).encode())


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    data = array("i", token_ids)
    if sys.byteorder != "little":   # the bytes hashed must not depend on the machine
        data.byteswap()
    extra = repr(extra_keys).encode() if extra_keys else b""
    return _digest(parent.to_bytes(8, "little") + data.tobytes() + extra)


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        seed: int = 0, salt: str | None = None) -> list[BlockHash]:
    """Append to `hashes` the hashes of the full blocks of `token_ids` not hashed yet; return it.

    `salt` (a per-request cache salt) enters the first block only, which isolates the whole chain.
    """
    parent = hashes[-1] if hashes else root_hash(seed)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        extra = (salt,) if salt is not None and start == 0 else ()
        parent = hash_block(parent, token_ids[start:start + block_size], extra)
        hashes.append(parent)
    return hashes


def block_hashes(token_ids: Sequence[int], block_size: int, seed: int = 0,
                 salt: str | None = None) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`."""
    return extend_block_hashes([], token_ids, block_size, seed, salt)


def group_block_hash(block_hash: BlockHash, group: int) -> BlockHash:
    """The name of KV cache group `group`'s block whose span ends with the engine block named
    `block_hash` (kv_transfer/group_blocks.py), distinct from every other group's."""
    return _digest(block_hash.to_bytes(8, "little") + b"group:" + str(group).encode())


def _digest(data: bytes) -> BlockHash:
    return int.from_bytes(blake2b(data, digest_size=8).digest(), "little")
