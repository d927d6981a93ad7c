"""The machine's limits, measured on the spot: memory read bandwidth and fp32 matmul FLOP/s.

Benchmarks divide by these to say how close a figure is to what the hardware allows, and read
`preemptions()` around a timed part to say how much of the CPU other tasks took from it. This file
owns only the measurements; it never runs a model.
"""
from __future__ import annotations

import glob
import os
import statistics
import time
from dataclasses import dataclass

import torch

from rackserve.bench.record import cpu_name


def processor_name(device: str = "cpu") -> str:
    """What the figures were measured on: the GPU's name, or the CPU model and its wide-vector
    features (the same project runs on AMD Zen without AVX-512 and on Xeons with AMX)."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    return cpu_name()


@dataclass
class Limits:
    device: str
    processor: str
    threads: int
    mem_read_gbps: float        # GB/s reading a large tensor once
    matmul_gflops: float        # dense matmul in the benchmark's dtype
    # The widest ISA torch's own CPU kernels dispatch to ("AVX512", "AVX2", ...; ATEN_CPU_CAPABILITY
    # can hold it lower): the peers' and torch kernels' figures depend on it.
    torch_cpu_capability: str = ""

    def describe(self) -> str:
        return (f"{self.processor}, {self.threads} threads: memory read {self.mem_read_gbps:.1f} GB/s, "
                f"matmul {self.matmul_gflops:.0f} GFLOP/s")


def _median_seconds(fn, repeats: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _matmul_size(n: int, dtype: torch.dtype, longest_s: float = 1.0) -> int:
    """`n`, or a smaller multiple of 256 where one n x n matmul in `dtype` would take longer than
    `longest_s`: a dtype the CPU only emulates (bf16 on a Zen 3: ~100x slower than fp32, measured)
    must not turn the probe into minutes. A 512 x 512 matmul, timed after one untimed call,
    estimates the rate (low: a small matmul runs below the large one's rate)."""
    a = torch.randn(512, 512, dtype=dtype)
    a @ a
    t0 = time.perf_counter()
    a @ a
    rate = 2 * 512**3 / max(time.perf_counter() - t0, 1e-9)
    while n > 512 and 2 * n**3 / rate > longest_s:
        n -= 256
    return n


def measure_limits(device: str = "cpu", dtype: torch.dtype = torch.float32, repeats: int = 5) -> Limits:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    size = 256 * 2**20 if device == "cpu" else 2 * 2**30
    buf = torch.ones(size // 4, dtype=torch.float32, device=device)
    read_s = _median_seconds(lambda: buf.sum(), repeats, sync)
    n = 2048 if device == "cpu" else 8192
    if device == "cpu":
        n = _matmul_size(n, dtype)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    mm_s = _median_seconds(lambda: a @ b, max(3, repeats // 2), sync)
    return Limits(device, processor_name(device), torch.get_num_threads(), size / read_s / 1e9,
                  2 * n**3 / mm_s / 1e9, torch.backends.cpu.get_cpu_capability())


def preemptions() -> int | None:
    """This process's involuntary context switches so far, all its threads (Linux; None elsewhere).
    On a shared machine each is a scheduler slice another task took from one of our threads, and a
    step whose threads meet at barriers waits for it: a timed part's count says how shared it ran."""
    total = None
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/status"):
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith("nonvoluntary_ctxt_switches:"):
                        total = (total or 0) + int(line.split()[1])
        except OSError:                 # a thread that ended between the listing and the read
            continue
    return total
