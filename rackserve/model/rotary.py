"""Rotary position embedding (neox style, rotate_half), with the default, llama3 and yarn frequency
rules (yarn as transformers computes it, DeepSeek-V3's mscale and mscale_all_dim included: they
scale cos/sin here, and DeepSeek-V3 also scales its softmax by `yarn_mscale`).

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
    elif kind == "yarn":
        inv_freq = _yarn_scaling(inv_freq, rotary_dim, params)
    elif kind != "default":
        raise ValueError(f"rope_type {kind!r} is not supported (supported: default, llama3, yarn)")
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


def _yarn_scaling(inv_freq: torch.Tensor, rotary_dim: int, params: dict[str, Any]) -> torch.Tensor:
    # YaRN: dimensions that turn fewer than beta_slow times over the original context are
    # interpolated (slowed by `factor`), those that turn more than beta_fast times are kept, with a
    # linear ramp between. Bounds as transformers computes them (truncated to whole dimensions).
    base, factor = float(params["rope_theta"]), float(params["factor"])
    old_len = float(params["original_max_position_embeddings"])

    def dim_of(rotations: float) -> float:
        return rotary_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(params.get("beta_fast") or 32), dim_of(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched `scale` times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(params: dict[str, Any]) -> float:
    """The factor yarn applies to cos and sin (1 for the other rules)."""
    if params["rope_type"] != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor, mscale, mscale_all_dim = float(params["factor"]), params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]):
        super().__init__()
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inverse_frequencies(head_dim, params))
        factor = rope_attention_factor(params)
        cos, sin = freqs.cos() * factor, freqs.sin() * factor
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
