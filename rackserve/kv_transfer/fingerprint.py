"""The KV fingerprint: a short name for everything that shapes a KV block's bytes (the weights,
their dtype, the KV cache dtype, the block size, the TP split), so blocks kept outside an instance
(a disk tier, a pooled store) are only ever read back by instances that would compute the same
bytes, on any machine. An instance restarted with another checkpoint gets another fingerprint.

This file must never import torch; it reads only the weight files' sizes and their last MiB.
"""
from __future__ import annotations

import hashlib
import os

from rackserve.config import EngineConfig

_TAIL = 1 << 20   # weights sit at a file's end (after GGUF's or safetensors' header): it tells checkpoints apart


def _weight_files(model: str) -> list[str]:
    if os.path.isfile(model):
        return [model]
    return sorted(os.path.join(model, f) for f in os.listdir(model)
                  if f.endswith((".safetensors", ".gguf", ".bin")) or f == "config.json")


def kv_fingerprint(config: EngineConfig) -> str:
    digest = hashlib.blake2b(digest_size=8)
    for path in _weight_files(config.model.model):
        size = os.path.getsize(path)
        digest.update(f"{os.path.basename(path)}:{size}:".encode())
        with open(path, "rb") as f:
            f.seek(max(size - _TAIL, 0))
            digest.update(f.read())
    layout = (config.model.dtype, config.cache.cache_dtype or config.model.dtype, config.cache.block_size,
              config.parallel.tensor_parallel_size)
    digest.update(repr(layout).encode())
    return digest.hexdigest()
