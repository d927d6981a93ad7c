"""`rackserve bench gemv` measures what it names: every kernel multiplies the same random GGUF weight
(finite scales, so the product means something) and is charged the bytes its packed form reads."""
from __future__ import annotations

import torch

from rackserve.bench.gemv_bench import random_weight, time_kernels
from rackserve.model.native import unavailable_reason
from rackserve.model.quant.quantized_linear import QUANT_KERNELS


def test_gemv_bench_times_each_kernel_on_the_same_weight():
    kernels = [k for k, isa in (("vnni", "avx512"), ("avx2", "avx2")) if unavailable_reason(isa=isa) is None]
    kernels.append("int4")
    weight = random_weight("Q4_1", 40, 96)
    assert torch.isfinite(weight.dequantize()).all() and weight.scales.abs().max() > 0
    timed = time_kernels(kernels, "Q4_1", (40, 96), rows=1, repeats=2)
    assert list(timed) == kernels
    for k, t in timed.items():
        assert t["median_s"] > 0 and t["bytes"] == QUANT_KERNELS.get(k)(weight).weight_bytes_per_token()
