"""GGUF quantized blocks (Q4_0, Q4_1, Q8_0) decoded, without loss, into one form that torch's int4
CPU kernel consumes: 4-bit codes in groups of 32 along the input, each group with a scale and a
zero, w = (code - 8) * scale + zero (the kernel's convention).

- Q4_0 (d, 32 x 4-bit q):   w = d * (q - 8)      -> code q, scale d, zero 0
- Q4_1 (d, m, 32 x 4-bit q): w = d * q + m        -> code q, scale d, zero m + 8d
- Q8_0 (d, 32 x int8 q):     w = d * q. q + 128 = 16 hi + lo with hi, lo in [0, 16), so
  w = 16d (hi - 8) + d lo: two int4 groups (code hi, scale 16d, zero 0; code lo, scale d, zero 8d)
  whose products with the same 32 inputs add up to the exact Q8_0 product. Each Q8_0 block thus
  becomes two groups side by side (`expand` = 2), and the input is repeated to match.

`Int4Groups` is what a layer's loader receives and fills: it narrows and copies like a weight
tensor of shape [rows, in_features], so tensor parallelism slices it as it slices dense weights
(along the input only at group boundaries). This file must never run a matmul or know layers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32                     # elements of a GGUF block, and the kernel's group size
SUPPORTED = ("Q4_0", "Q4_1", "Q8_0")
_EXPAND = {"Q4_0": 1, "Q4_1": 1, "Q8_0": 2}


@dataclass
class Int4Groups:
    """A [rows, in_features] weight as int4 groups: codes [rows, in_features * expand] (uint8 in
    [0, 16)), scales and zeros [rows, in_features * expand / 32] (float32)."""
    qtype: str
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor

    @property
    def expand(self) -> int:
        return _EXPAND[self.qtype]

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] // self.expand

    @classmethod
    def empty(cls, qtype: str, rows: int, in_features: int) -> "Int4Groups":
        if in_features % GROUP:
            raise ValueError(f"a quantized weight splits along its input only at multiples of {GROUP}; this "
                             f"layer holds {in_features} input features (use --quantization none)")
        width = in_features * _EXPAND[qtype]
        return cls(qtype, torch.empty(rows, width, dtype=torch.uint8),
                   torch.empty(rows, width // GROUP), torch.empty(rows, width // GROUP))

    def narrow(self, dim: int, start: int, length: int) -> "Int4Groups":
        if dim == 0:
            return Int4Groups(self.qtype, self.codes.narrow(0, start, length), self.scales.narrow(0, start, length),
                              self.zeros.narrow(0, start, length))
        assert dim == 1
        if start % GROUP or length % GROUP:
            raise ValueError(f"a quantized weight splits along its input only at multiples of {GROUP}; "
                             f"asked for [{start}, {start + length}) (use --quantization none)")
        e = self.expand
        g0, gn = start * e // GROUP, length * e // GROUP
        return Int4Groups(self.qtype, self.codes.narrow(1, start * e, length * e), self.scales.narrow(1, g0, gn),
                          self.zeros.narrow(1, g0, gn))

    def copy_(self, src: "Int4Groups") -> None:
        if src.qtype != self.qtype or src.shape != self.shape:
            raise ValueError(f"cannot load {src.qtype} {src.shape} into {self.qtype} {self.shape}: one fused layer "
                             "needs one quantization type (use --quantization none)")
        self.codes.copy_(src.codes)
        self.scales.copy_(src.scales)
        self.zeros.copy_(src.zeros)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        rows, width = self.codes.shape
        groups = (self.codes.view(rows, -1, GROUP).to(dtype) - 8) * self.scales.unsqueeze(-1).to(dtype) \
            + self.zeros.unsqueeze(-1).to(dtype)
        # Q8_0: the hi and lo groups of a block add up to its values.
        return groups.view(rows, -1, self.expand, GROUP).sum(2).view(rows, width // self.expand)


def packed_nbytes(qtype: str, numel: int, kernel: str = "int4") -> int:
    """What a quantized-linear kernel reads for a weight of `numel` elements. "int4": 4-bit codes
    and a bf16 scale and zero per group (Q8_0 as two groups); "vnni" and "avx2": the GGUF block itself
    (codes, fp16 scale, and Q4_1's fp16 minimum)."""
    if kernel in ("vnni", "avx2"):
        return numel // GROUP * {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[qtype]
    width = numel * _EXPAND[qtype]
    return width // 2 + width // GROUP * 4


def from_gguf(qtype: str, blocks: np.ndarray) -> Int4Groups:
    """Decode a GGUF tensor's raw bytes ([rows, bytes per row], as gguf.GGUFReader gives them)."""
    if qtype not in SUPPORTED:
        raise ValueError(f"GGUF type {qtype} is not kept quantized; supported: {SUPPORTED}")
    rows = blocks.shape[0]
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[qtype]
    b = np.ascontiguousarray(blocks).reshape(rows, -1, size)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)         # [rows, blocks]
    if qtype == "Q8_0":
        u = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # [rows, blocks, 32]
        codes = np.stack([u >> 4, u & 15], axis=2)                            # [rows, blocks, 2, 32]
        scales = np.stack([16 * d, d], axis=2)
        zeros = np.stack([np.zeros_like(d), 8 * d], axis=2)
    else:
        qs = b[..., -16:]
        # Element j of a block is the low nibble of byte j, element j + 16 its high nibble.
        codes = np.concatenate([qs & 15, qs >> 4], axis=-1)
        scales = d
        zeros = np.zeros_like(d) if qtype == "Q4_0" else b[..., 2:4].copy().view(np.float16)[..., 0] + 8 * d
    as_t = lambda a, dt: torch.from_numpy(np.ascontiguousarray(a, dtype=dt).reshape(rows, -1))  # noqa: E731
    return Int4Groups(qtype, as_t(codes, np.uint8), as_t(scales, np.float32), as_t(zeros, np.float32))
