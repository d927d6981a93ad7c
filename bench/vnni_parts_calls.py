"""The vnni kernel's calls at prompt-chunk size in each --packed-activations mode, in one process:
random Q4_1 weights (gguf-py's quantization) of SmolLM2's four linear shapes, 512 rows of
activations with one large value per row, the modes alternating round by round. Prints each
mode's median milliseconds a call and its speed against two-part, and writes them as JSON.

    python bench/vnni_parts_calls.py --output bench/results/vnni-parts-calls-zen5-s19.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from rackserve.bench.record import machine_state
from rackserve.model.quant.gguf_blocks import from_gguf
from rackserve.model.quant.vnni_linear import VnniLinear

SHAPES = {"gate_up": (3072, 576), "down": (576, 1536), "qkv": (960, 576), "o": (576, 576)}
MODES = ("two-part", "adaptive", "one-part")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10, help="calls a timing")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    rng = np.random.default_rng(0)
    results = {}
    for name, (out_f, in_f) in SHAPES.items():
        w = rng.standard_normal((out_f, in_f)).astype(np.float32)
        linear = VnniLinear(from_gguf("Q4_1", quantize(w, GGMLQuantizationType.Q4_1)))
        x = torch.randn(args.rows, in_f, generator=torch.Generator().manual_seed(0))
        x[:, 7] *= 20
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(args.rounds):
            for mode in MODES:
                linear.use_activation_parts(mode)
                linear(x)
                start = time.perf_counter()
                for _ in range(args.calls):
                    linear(x)
                times[mode].append((time.perf_counter() - start) / args.calls * 1e3)
        med = {m: statistics.median(t) for m, t in times.items()}
        results[name] = {"shape": [out_f, in_f], "median_ms": med, "ms": times}
        gflops = 2 * args.rows * out_f * in_f / 1e6
        print(f"{name:>8} {out_f}x{in_f}, {args.rows} rows: " + ", ".join(
            f"{m} {med[m]:.2f} ms ({gflops / med[m]:.0f} GFLOP/s, {med['two-part'] / med[m]:.2f}x)" for m in MODES))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"command": "python " + " ".join(sys.argv), "bench": "vnni_parts_calls", "rows": args.rows,
                       "threads": args.threads, "load_average_before": load_before, **machine_state(),
                       "results": results}, f, indent=1)
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
