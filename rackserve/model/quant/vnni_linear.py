"""The "vnni" quantized-linear kernel: GGUF's Q4_0 / Q4_1 / Q8_0 blocks multiplied with int8 dot
products (AVX-512 VNNI), llama.cpp's method: each row of x is quantized to int8 per block of 32 (in two parts,
below) and meets the weight's 4- or 8-bit codes in integer sums, scaled per block by the weight's fp16 scale
(and, for Q4_1, its fp16 minimum times the block's float sum of x). The weight is repacked once, at
load, into 16-row tiles (csrc/vnni_gemv.cpp says the layout), the same bytes per weight as the GGUF
file: 0.625 (Q4_1), 0.5625 (Q4_0), 1.0625 (Q8_0).

Each block of activations is written as two int8 parts (the int8 quantization and that of its
residual), so outputs match the fp32 matmul of the dequantized weight to ~1e-5 of a row's scale,
where llama.cpp's one part leaves ~0.5%. --packed-activations trades that for prompt-chunk speed
(ACTIVATION_PARTS). The native library (model/native.py) holds the kernel; this file must never
read checkpoints.
"""
from __future__ import annotations

import ctypes
import math
import sys

import torch
import torch.nn.functional as F

from rackserve.model.native import unavailable_reason
from rackserve.model.native_ops import load
from rackserve.model.quant.gguf_blocks import GROUP, Int4Groups
from rackserve.model.quant.quantized_linear import QUANT_KERNELS, QuantizedLinear

TILE = 16                                   # output rows a tile interleaves: the int32 lanes of a zmm
KINDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}   # the kernel's `kind`
# --packed-activations: a block keeps its residual part where its largest |x| exceeds this many times
# its row's RMS (rs_vnni_gemv_parts); None: everywhere. The adaptive threshold is measured in
# docs/benchmarks.md ("Nineteenth round"): ~30% of the residual work left, ~0.6x bf16's logit KL.
ACTIVATION_PARTS = {"two-part": None, "adaptive": 6.0, "one-part": math.inf}
# Calls of fewer rows keep both parts: a decode step's few rows wait on the weight's bytes, not on
# the dot products (and the native decode step calls rs_vnni_gemv itself).
PARTS_MIN_ROWS = 64


def _tiles_of(rows_first: torch.Tensor, tiles: int, tile: int) -> torch.Tensor:
    """[rows, blocks] fp16 values -> [tiles, blocks, tile * 2 bytes]: a block's `tile` rows side by side."""
    return rows_first.to(torch.float16).view(tiles, tile, -1).transpose(1, 2).contiguous().view(torch.uint8)


def pack(weight: Int4Groups, tile: int = TILE, signed_q8: bool = False) -> torch.Tensor:
    """The kernel's records, uint8 [tiles, blocks, bytes]: per tile and block of 32 inputs, the `tile`
    rows' codes interleaved 4 at a time, then the fp16 scales d, then (Q4_1) the minimums m. Q8_0's
    codes are q + 128, or q's int8 bytes with `signed_q8` (csrc/avx2_gemv.cpp's layout)."""
    n, k = weight.shape
    pad, nb = -n % tile, k // GROUP
    tiles = (n + pad) // tile
    if weight.qtype == "Q8_0":
        # The hi and lo groups give back q + 128 = 16 hi + lo, the lo group's scale d.
        codes = (weight.codes.view(n, nb, 2, GROUP)[:, :, 0] << 4) | weight.codes.view(n, nb, 2, GROUP)[:, :, 1]
        codes, d, m = codes ^ 128 if signed_q8 else codes, weight.scales.view(n, nb, 2)[..., 1], None
    else:
        codes, d = weight.codes.view(n, nb, GROUP), weight.scales
        # w = (code - 8) * scale + zero = d * code + m: m = zero - 8 d (fp16 in the file, exact here).
        m = weight.zeros - 8 * weight.scales if weight.qtype == "Q4_1" else None
    codes, d = F.pad(codes, (0, 0, 0, 0, 0, pad)), F.pad(d, (0, 0, 0, pad))
    if weight.qtype == "Q8_0":
        # byte (j, r, i) = code[r][4j + i]
        c = codes.view(tiles, tile, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(tiles, nb, 32 * tile)
    else:
        # byte (j, r, i) = code[r][4j + i] | code[r][16 + 4j + i] << 4
        c = codes.view(tiles, tile, nb, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)
        c = (c[..., 0] | (c[..., 1] << 4)).reshape(tiles, nb, 16 * tile)
    parts = [c, _tiles_of(d, tiles, tile)]
    if m is not None:
        parts.append(_tiles_of(F.pad(m, (0, 0, 0, pad)), tiles, tile))
    return torch.cat(parts, -1).contiguous()


@QUANT_KERNELS.register("vnni")
class VnniLinear(QuantizedLinear):
    """Buffer `packed`: the tiles of `pack`, beside the shared plain codes. The class attributes
    below name the build and layout; avx2_linear.py's kernel differs only in them."""

    isa, gemv, tile, signed_q8 = "avx512", "rs_vnni_gemv", TILE, False
    # Never dense: with blocks of 8 rows the kernel ran 1.1-1.3x torch's fp32 GEMM of the weight
    # already dequantized at 512 and 2048 rows (3072x576 and 576x1536 Q4_1, 2 threads), before
    # counting the dequantization a dense call would pay.
    dense_above_rows = sys.maxsize
    rounds_outputs = False      # ~1e-5 of a row's scale: no top logits to recompute

    def __init__(self, weight: Int4Groups):
        super().__init__(weight)
        lib = load(self.isa)
        if lib is None:
            raise RuntimeError(f"this quantized-linear kernel cannot run here: {unavailable_reason(isa=self.isa)} "
                               "(use --quant-kernel auto or int4)")
        self._gemv = getattr(lib, self.gemv)
        self._gemv_parts = getattr(lib, "rs_vnni_gemv_parts", None)   # the avx512 build's only
        self.activation_tau: float | None = None
        self.kind = KINDS[weight.qtype]
        self.register_buffer("packed", pack(weight, self.tile, self.signed_q8))

    def weight_bytes_per_token(self) -> int:
        return self.packed.numel()

    def use_activation_parts(self, mode: str) -> None:
        """--packed-activations: two int8 parts everywhere, one part, or one where a block holds no
        large activation (ACTIVATION_PARTS), in calls of PARTS_MIN_ROWS rows or more."""
        if mode != "two-part" and self._gemv_parts is None:
            raise ValueError(f"--packed-activations {mode}: only the vnni kernel has it, not {self.gemv}")
        self.activation_tau = ACTIVATION_PARTS[mode]

    def native_gemv(self) -> tuple[int, int]:
        """(address of the C function that multiplies `packed`, output rows a tile): what the native
        decode step (model/native_decode.py) calls for this weight."""
        return ctypes.cast(self._gemv, ctypes.c_void_p).value, self.tile

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32).contiguous()
        tiles = self.packed.shape[0]
        y = torch.empty(xf.shape[0], tiles * self.tile)
        args = (xf.data_ptr(), xf.shape[0], self.in_features, self.packed.data_ptr(), tiles, self.kind, y.data_ptr(),
                torch.get_num_threads())
        if self.activation_tau is not None and xf.shape[0] >= PARTS_MIN_ROWS:
            rc = self._gemv_parts(*args, self.activation_tau)
        else:
            rc = self._gemv(*args)
        assert rc == 0, f"{self.gemv} refused its arguments"
        return (y if y.shape[1] == self.out_features else y[:, :self.out_features]).to(x.dtype)
