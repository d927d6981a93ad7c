"""Efficiency factors: the fraction of a published peak that each class of operation reaches on a
GPU, one number each, with where it comes from. The cost model divides peaks by nothing else.

A device's own `efficiency` (hardware.py; a `cpu` calibration sets them all) overrides these.
This file owns the numbers; it must never compute a cost.
"""
from __future__ import annotations

EFFICIENCY: dict[str, float] = {
    # Large dense GEMMs (prefill, big decode batches): ~70% of dense peak, the usual cuBLAS/CUTLASS
    # share on H100/B200 for bf16/fp8 at K, N >= 4096 (NVIDIA's own GEMM benchmarks; vLLM's
    # benchmark_matmul results are in the same range).
    "gemm_flops": 0.70,
    # Grouped MoE GEMMs: lower than dense, many small expert tiles (DeepGEMM reports ~55-65% of
    # peak for its grouped FP8 kernels on H800).
    "moe_flops": 0.55,
    # Attention math: FlashAttention-3 reaches ~75% of H100 bf16 peak in prefill; FlashMLA
    # decode ~60% of the compute roof. 0.6 covers both.
    "attn_flops": 0.60,
    # Streaming weights and KV from HBM: ~80-85% of datasheet bandwidth is what memcpy-like
    # kernels reach (STREAM-like measurements on H100/H200; FlashMLA decode reports ~3 TB/s of
    # 3.35 on H800 = 0.9 at best).
    "mem_bw": 0.80,
    # Reading the paged KV cache in attention: FlashInfer/FlashMLA decode kernels reach about
    # the same share as weight streaming on long contexts (short ones are latency-bound).
    "attn_mem_bw": 0.80,
    # NCCL all-reduce / all-to-all bus bandwidth over NVLink: ~75-85% of the per-direction link
    # (nccl-tests busbw); DeepEP reports ~150 GB/s of NVLink 4's 225 per direction per GPU.
    "link_bw": 0.70,
}

# VR200: no published source gives a Rubin GPU's achieved fractions. The seeds say its kernels are
# being rewritten for SM107 and that each GPU has two memory domains (an SM reads its own faster),
# and that a DEP decode step is only ~25% faster than GB300's (a prefill step ~28%) against 2.4x the
# HBM bandwidth and 5x the FP4 FLOP/s of GB200 (hardware.py). One factor on every class but the
# links (NVLink's ratio is given apart), FITTED to that one figure (DEP4 decode at 128K, 64 requests
# a rank: 0.75x GB300's step) by `python -m rackserve.sim.seeds`; the DEP2 prefill step ratio and the
# batch-1 TP8 rate are left out of the fit and checked against it (docs/simulator.md).
VR200_ACHIEVED = 0.53
DEVICE_EFFICIENCY: dict[str, dict[str, float]] = {
    "VR200": {op: share * VR200_ACHIEVED for op, share in EFFICIENCY.items() if op != "link_bw"},
}


def efficiency(op: str, overrides: dict[str, float] | None = None) -> float:
    if overrides and op in overrides:
        return overrides[op]
    return EFFICIENCY[op]
