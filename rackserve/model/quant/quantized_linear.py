"""What every quantized-linear kernel shares: y = x W^T for a weight given as int4 groups
(gguf_blocks.Int4Groups), the plain codes, scales and zeros kept for the exact paths, and the
registry by name (`--quant-kernel`) of the kernels that compute it on a packed form:
"int4" (torch's weight-only int4 kernel, int4_linear.py) and "vnni" (int8 dot products with
AVX-512 VNNI, vnni_linear.py). A kernel subclass packs in `__init__` and multiplies in `_kernel`;
steps of more rows than its `dense_above_rows` dequantize the weight for that call and run a dense
GEMM instead (a prefill chunk amortises that one pass over the weight). This file must never read
checkpoints nor choose the kernel (config.py resolves `auto`, quant/kernel_choice.py says why).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rackserve.model.quant.gguf_blocks import Int4Groups
from rackserve.registry import Registry


class QuantizedLinear(nn.Module):
    """Buffers every kernel keeps beside its own packed form: the codes (two to a byte), scales
    and zeros that the dense and exact paths dequantize from."""

    dense_above_rows: int = 128
    # Whether outputs are rounded coarsely enough to tie or swap close logits (bf16): then
    # `exact_top` recomputes the largest ones; a kernel as exact as fp32 skips that.
    rounds_outputs: bool = True

    def __init__(self, weight: Int4Groups):
        super().__init__()
        self.qtype, self.expand = weight.qtype, weight.expand
        self.out_features, self.in_features = weight.shape
        self.register_buffer("codes", weight.codes[:, 0::2] | (weight.codes[:, 1::2] << 4))
        self.register_buffer("scales", weight.scales.clone())
        self.register_buffer("zeros", weight.zeros.clone())

    def use_activation_parts(self, mode: str) -> None:
        """--packed-activations; only the vnni kernel (vnni_linear.py) has a choice."""
        if mode != "two-part":
            raise ValueError(f"--packed-activations {mode}: only the vnni kernel has it, not {type(self).__name__}")

    def weight_bytes_per_token(self) -> int:
        """Bytes one decode step reads from the kernel's packed form."""
        raise NotImplementedError

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T on the packed weight, for at most `dense_above_rows` rows; x's dtype out."""
        raise NotImplementedError

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
        """x W^T. Kernels round (bf16 outputs, int8 activations), which can tie or swap logits
        that differ; with `exact_top` the `exact_top` largest outputs of each row are recomputed
        in x's dtype, so that greedy choices and top logprobs are those of the dequantized weight."""
        if x.shape[0] > self.dense_above_rows:
            return F.linear(x, self.dequantize(x.dtype))
        y = self._kernel(x)
        if exact_top and self.rounds_outputs:
            top = y.topk(min(exact_top, y.shape[1]), dim=-1).indices
            y.scatter_(1, top, self.exact_rows(x, top))
        return y


# Kernel "x" lives in quant/x_linear.py.
QUANT_KERNELS: Registry[type[QuantizedLinear]] = Registry("quantized-linear kernel",
                                                          "rackserve.model.quant.{}_linear")
