"""The "avx2" quantized-linear kernel: the "vnni" kernel's method and numerics (GGUF's Q4_0 / Q4_1
/ Q8_0 blocks against int8 activations in two parts, fp32-exact to ~1e-5) for CPUs with AVX2, FMA
and F16C but no AVX-512 VNNI, as AMD Zen 1/2/3: four-product int8 sums by vpmaddubsw + vpmaddwd
(llama.cpp's AVX2 path) for a prefill's rows, and for a decode batch's few rows the activations as
one int16 part against the codes widened in place by vpmaddwd (Zen 1 is bound by its integer
multiplies), in the native library's "avx2" build (csrc/avx2_gemv.cpp). Its weight
records are vnni_linear.pack's with 8-row tiles (a ymm's int32 lanes) and Q8_0 codes as signed
bytes, the same bytes per weight as the GGUF file. Where the few-rows path hands over to the
many-rows one is measured once per process on this CPU (`measure_many_rows`). This file must
never read checkpoints.
"""
from __future__ import annotations

import logging
import sys
import time

import torch

from rackserve.model.native_ops import load
from rackserve.model.quant.gguf_blocks import Int4Groups
from rackserve.model.quant.quantized_linear import QUANT_KERNELS
from rackserve.model.quant.vnni_linear import VnniLinear, pack

logger = logging.getLogger(__name__)

DEFAULT_MANY_ROWS = 5           # csrc/avx2_gemv.cpp's kManyRows: the crossover until one is measured
CANDIDATE_ROWS = range(2, 7)    # the crossovers measure_many_rows may pick (7: above them all)


def pick_many_rows(few_s: dict[int, float], many_s: dict[int, float]) -> int:
    """The smallest row count from which the many-rows path was faster at every measured count
    (its seconds against the few-rows path's per count); past the largest count when it never was."""
    rows = sorted(few_s)
    pick = rows[-1] + 1
    for r in reversed(rows):
        if many_s[r] >= few_s[r]:
            break
        pick = r
    return pick


def measure_many_rows(lib, threads: int, repeats: int = 15) -> tuple[int, dict[int, float], dict[int, float]]:
    """Times both paths of rs_avx2_gemv at CANDIDATE_ROWS rows on a random 1536x576 Q4_1 weight (a
    SmolLM2-sized layer, ~0.5 MB, read from L2/L3 after the first round: the multiplies are what
    differ, the weight's bytes are the same on both paths), the two paths
    alternating call by call, and returns (pick_many_rows of the fastest calls, few-rows seconds,
    many-rows seconds): the fastest of many, as other processes on the CPU only ever slow a call.
    Leaves the library's crossover as it found it."""
    g = torch.Generator().manual_seed(0)
    n, k = 1536, 576
    weight = Int4Groups("Q4_1", torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g),
                        torch.rand(n, k // 32, generator=g) * 0.01, torch.rand(n, k // 32, generator=g) * 0.01)
    packed = pack(weight, 8, True)
    x = torch.randn(max(CANDIDATE_ROWS), k, generator=g)
    y = torch.empty(x.shape[0], n)
    few: dict[int, list[float]] = {r: [] for r in CANDIDATE_ROWS}
    many: dict[int, list[float]] = {r: [] for r in CANDIDATE_ROWS}
    before = lib.rs_avx2_set_many_rows(DEFAULT_MANY_ROWS)
    try:
        for _ in range(repeats + 1):            # the first round warms the caches and is dropped
            for r in CANDIDATE_ROWS:
                for crossover, times in ((r + 1, few), (r, many)):
                    lib.rs_avx2_set_many_rows(crossover)
                    t = time.perf_counter()
                    lib.rs_avx2_gemv(x.data_ptr(), r, k, packed.data_ptr(), n // 8, 1, y.data_ptr(), threads)
                    times[r].append(time.perf_counter() - t)
    finally:
        lib.rs_avx2_set_many_rows(before)
    few_s = {r: min(ts[1:]) for r, ts in few.items()}
    many_s = {r: min(ts[1:]) for r, ts in many.items()}
    return pick_many_rows(few_s, many_s), few_s, many_s


_chosen: int | None = None       # the crossover set on this process's avx2 library, once measured


def choose_many_rows() -> int:
    """Measures the crossover on this CPU once per process (the library's global) and sets it;
    returns it. The log says what was measured."""
    global _chosen
    if _chosen is None:
        lib = load("avx2")
        # One thread: the paths' difference is each core's instruction mix, and a team of two on a
        # busy machine times mostly the slower thread's wait.
        threads = 1
        pick, few, many = measure_many_rows(lib, threads)
        lib.rs_avx2_set_many_rows(pick)
        _chosen = pick
        logger.info("avx2 kernel: the many-rows path from %d rows (measured here on %d thread: few-rows / many-rows "
                    "at %s)", pick, threads, ", ".join(f"{r} rows {few[r] / many[r]:.2f}x" for r in CANDIDATE_ROWS))
    return _chosen


def chosen_many_rows() -> int | None:
    """The crossover set in this process (None before an Avx2Linear was built)."""
    return _chosen


def set_many_rows(rows: int) -> int:
    """Sets the crossover (for tests and A/B runs); returns the one it replaced."""
    global _chosen
    before = load("avx2").rs_avx2_set_many_rows(rows)
    _chosen = rows
    return before


@QUANT_KERNELS.register("avx2")
class Avx2Linear(VnniLinear):
    isa, gemv, tile, signed_q8 = "avx2", "rs_avx2_gemv", 8, True
    # Never dense: on a Zen 3 (2 threads) the many-rows tile call ran 1.1-3.2x torch's fp32 GEMM of
    # SmolLM2's four weights already dequantized at 8-256 rows and 0.89-1.6x at 512, 1.1-2.05x there
    # once the dequantization a dense call pays is counted (bench/results/avx2-gemm-ab-main-v3-dense-s9z.json);
    # on a loaded Zen 1 1.05-3.1x at 5-512 rows, 0.94x for 3072x576 at 512 (docs/benchmarks.md, thirteenth round).
    # (The per-row kernel had lost to it above 256 rows on the AVX-512 Xeon.)
    dense_above_rows = sys.maxsize

    def __init__(self, weight: Int4Groups):
        super().__init__(weight)
        choose_many_rows()
