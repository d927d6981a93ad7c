"""The "avx2" quantized-linear kernel: the "vnni" kernel's method and numerics (GGUF's Q4_0 / Q4_1
/ Q8_0 blocks against int8 activations in two parts, fp32-exact to ~1e-5) for CPUs with AVX2, FMA
and F16C but no AVX-512 VNNI, as AMD Zen 1/2/3: four-product int8 sums by vpmaddubsw + vpmaddwd
(llama.cpp's AVX2 path) for a prefill's rows, and for a decode batch's few rows the activations as
one int16 part against the codes widened in place by vpmaddwd (Zen 1 is bound by its integer
multiplies), in the native library's "avx2" build (csrc/avx2_gemv.cpp). Its weight
records are vnni_linear.pack's with 8-row tiles (a ymm's int32 lanes) and Q8_0 codes as signed
bytes, the same bytes per weight as the GGUF file. This file must never read checkpoints.
"""
from __future__ import annotations

import sys

from rackserve.model.native_ops import load
from rackserve.model.quant.gguf_blocks import Int4Groups
from rackserve.model.quant.quantized_linear import QUANT_KERNELS
from rackserve.model.quant.vnni_linear import VnniLinear

DEFAULT_MANY_ROWS = 5           # csrc/avx2_gemv.cpp's kManyRows: where the few-rows path hands over


def set_many_rows(rows: int) -> int:
    """Sets the row count from which calls take the many-rows path (for tests and A/B runs: both
    paths at any rows); returns the one it replaced."""
    return load("avx2").rs_avx2_set_many_rows(rows)


@QUANT_KERNELS.register("avx2")
class Avx2Linear(VnniLinear):
    isa, gemv, tile, signed_q8 = "avx2", "rs_avx2_gemv", 8, True
    # Never dense: on a Zen 3 (2 threads) the many-rows tile call ran 1.1-3.2x torch's fp32 GEMM of
    # SmolLM2's four weights already dequantized at 8-256 rows and 0.89-1.6x at 512, 1.1-2.05x there
    # once the dequantization a dense call pays is counted (bench/results/avx2-gemm-ab-main-v3-dense-s9z.json);
    # on a loaded Zen 1 1.05-3.1x at 5-512 rows, 0.94x for 3072x576 at 512 (docs/benchmarks.md, thirteenth round).
    # (The per-row kernel had lost to it above 256 rows on the AVX-512 Xeon.)
    dense_above_rows = sys.maxsize

