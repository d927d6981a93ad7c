"""Rotary position embedding (neox style, rotate_half), with the default and llama3 frequency rules.

cos/sin are precomputed once for every position up to the model's length and indexed by the step's
positions once per forward; each layer then applies them with four elementwise ops. This file
must never know about attention, caches or weights.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """Normalise both config spellings: transformers 5 `rope_parameters` and the older top-level
    `rope_theta` + `rope_scaling` (`type` or `rope_type`), as real checkpoints still carry."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def inverse_frequencies(rotary_dim: int, params: dict[str, Any]) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    kind = params["rope_type"]
    if kind == "llama3":
        inv_freq = _llama3_scaling(inv_freq, params)
    elif kind != "default":
        raise ValueError(f"rope_type {kind!r} is not supported (supported: default, llama3)")
    if "freq_factors" in params:
        # GGUF (llama.cpp) spelling of a frequency-wise scaling: divisors of each frequency.
        inv_freq = inv_freq / torch.tensor(params["freq_factors"], dtype=torch.float32)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band between
    # interpolated linearly in 1/wavelength.
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, scaled)
    return torch.where(wavelen < old_len / high, inv_freq, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]):
        super().__init__()
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inverse_frequencies(head_dim, params))
        cos, sin = freqs.cos(), freqs.sin()
        dtype = torch.get_default_dtype()
        # sin carries rotate_half's sign so that rope(x) = x * cos + roll(x, half) * sin.
        self.register_buffer("cos", torch.cat([cos, cos], -1).to(dtype), persistent=False)
        self.register_buffer("sin", torch.cat([-sin, sin], -1).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each position, shaped [T, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin
