"""The "int4" quantized-linear kernel: torch's weight-only int4 CPU kernel
(`_weight_int4pack_mm_for_cpu`) on the packed weight, never on a dequantized copy. It runs
everywhere torch does, so it is the fallback where the "vnni" kernel cannot (no compiler, no
AVX-512 VNNI).

Measured on this project's 2-core Xeon (AVX-512, no native bf16), SmolLM2 shapes, one thread:
the kernel with bf16 activations multiplies one token by a 3072x576 weight in ~0.12 ms against
0.29 ms for fp32 `F.linear`, and the 49152x576 lm_head in ~2.2 ms against ~23 ms; with fp32 or
fp16 activations it falls back to a path 50x slower, so activations go in as bf16 (scales and
zeros are bf16 too, as the kernel requires) and come back in the caller's dtype. For many rows
(a prefill chunk) the kernel loses to a dense GEMM (at 256 rows ~35 ms against ~11 ms), hence
`DENSE_ABOVE_ROWS`. This file must never read checkpoints.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rackserve.model.quant.gguf_blocks import GROUP, Int4Groups
from rackserve.model.quant.quantized_linear import QUANT_KERNELS, QuantizedLinear

DENSE_ABOVE_ROWS = 128          # crossover measured as above (between 64 and 256 rows)


@QUANT_KERNELS.register("int4")
class PackedInt4Linear(QuantizedLinear):
    """Buffers: `packed` (the kernel's layout) and `scales_zeros` [groups, out, 2] bf16, beside
    the shared plain codes."""

    dense_above_rows = DENSE_ABOVE_ROWS

    def __init__(self, weight: Int4Groups):
        super().__init__(weight)
        # The kernel packs output rows 16 at a time: pad with rows of zero scale (outputs 0, cut off).
        pad = -self.out_features % 16
        codes, scales, zeros = (F.pad(t, (0, 0, 0, pad)) for t in (weight.codes, weight.scales, weight.zeros))
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1))
        self.register_buffer("scales_zeros", torch.stack([scales, zeros], -1).transpose(0, 1).contiguous()
                             .to(torch.bfloat16))

    def weight_bytes_per_token(self) -> int:
        """The packed codes and the bf16 scales and zeros."""
        return self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * 2

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16)
        if self.expand > 1:
            # Each block of 32 inputs meets the hi and the lo group of its Q8_0 block.
            t = xb.shape[0]
            xb = xb.view(t, -1, 1, GROUP).expand(t, -1, self.expand, GROUP).reshape(t, -1)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, GROUP, self.scales_zeros)
        return (y if y.shape[1] == self.out_features else y[:, :self.out_features]).to(x.dtype)
