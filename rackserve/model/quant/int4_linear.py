"""y = x W^T for a weight held as int4 groups (quant/gguf_blocks.py), computed by torch's weight-only
int4 CPU kernel (`_weight_int4pack_mm_for_cpu`) on the packed weight, never on a dequantized copy.

Measured on this project's 2-core Xeon (AVX-512, no native bf16), SmolLM2 shapes, one thread:
the kernel with bf16 activations multiplies one token by a 3072x576 weight in ~0.12 ms against
0.29 ms for fp32 `F.linear`, and the 49152x576 lm_head in ~2.2 ms against ~23 ms; with fp32 or
fp16 activations it falls back to a path 50x slower, so activations go in as bf16 (scales and
zeros are bf16 too, as the kernel requires) and come back in the caller's dtype. For many rows
(a prefill chunk) the kernel loses to a dense GEMM (at 256 rows ~35 ms against ~11 ms), so above
`DENSE_ABOVE_ROWS` rows the weight is dequantized for that call and multiplied densely: that costs
one pass over the weight, amortised over the rows. This file must never read checkpoints.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rackserve.model.quant.gguf_blocks import GROUP, Int4Groups

DENSE_ABOVE_ROWS = 128          # crossover measured as above (between 64 and 256 rows)


class PackedInt4Linear(nn.Module):
    """The packed form of one layer's Int4Groups. Buffers: `packed` (the kernel's layout),
    `scales_zeros` [groups, out, 2] bf16, and the plain codes (two to a byte), scales and zeros
    that the dense path dequantizes from."""

    def __init__(self, weight: Int4Groups):
        super().__init__()
        self.qtype, self.expand = weight.qtype, weight.expand
        self.out_features, self.in_features = weight.shape
        # The kernel packs output rows 16 at a time: pad with rows of zero scale (outputs 0, cut off).
        pad = -self.out_features % 16
        codes, scales, zeros = (F.pad(t, (0, 0, 0, pad)) for t in (weight.codes, weight.scales, weight.zeros))
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1))
        self.register_buffer("scales_zeros", torch.stack([scales, zeros], -1).transpose(0, 1).contiguous()
                             .to(torch.bfloat16))
        self.register_buffer("codes", weight.codes[:, 0::2] | (weight.codes[:, 1::2] << 4))
        self.register_buffer("scales", weight.scales.clone())
        self.register_buffer("zeros", weight.zeros.clone())

    def weight_bytes_per_token(self) -> int:
        """Bytes one decode step reads: the packed codes and the bf16 scales and zeros."""
        return self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * 2

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        codes = torch.stack([self.codes & 15, self.codes >> 4], -1).view(self.codes.shape[0], -1)
        return Int4Groups(self.qtype, codes, self.scales, self.zeros).dequantize(dtype)

    def exact_rows(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """x[i] . W[rows[i, j]] in x's dtype from the dequantized rows: [R, k] for rows [R, k]."""
        r, k = rows.shape
        flat = rows.flatten()
        codes = self.codes[flat]
        picked = Int4Groups(self.qtype, torch.stack([codes & 15, codes >> 4], -1).view(r * k, -1),
                            self.scales[flat], self.zeros[flat])
        return torch.bmm(picked.dequantize(x.dtype).view(r, k, -1), x.unsqueeze(-1)).squeeze(-1)

    def forward(self, x: torch.Tensor, exact_top: int = 0) -> torch.Tensor:
        """x W^T. The kernel rounds its outputs to bf16 (steps of 1/8 at 16-32), which ties logits
        that differ; with `exact_top` the `exact_top` largest outputs of each row are recomputed
        in x's dtype, so that greedy choices and top logprobs are those of the dequantized weight."""
        y = self._matmul(x)
        if exact_top and x.shape[0] <= DENSE_ABOVE_ROWS:
            top = y.topk(min(exact_top, y.shape[1]), dim=-1).indices
            y.scatter_(1, top, self.exact_rows(x, top))
        return y

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > DENSE_ABOVE_ROWS:
            return F.linear(x, self.dequantize(x.dtype))
        xb = x.to(torch.bfloat16)
        if self.expand > 1:
            # Each block of 32 inputs meets the hi and the lo group of its Q8_0 block.
            t = xb.shape[0]
            xb = xb.view(t, -1, 1, GROUP).expand(t, -1, self.expand, GROUP).reshape(t, -1)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, GROUP, self.scales_zeros)
        return (y if y.shape[1] == self.out_features else y[:, :self.out_features]).to(x.dtype)
