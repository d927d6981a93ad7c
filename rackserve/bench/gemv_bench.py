"""`rackserve bench gemv`: the quantized-linear kernels (vnni, avx2, int4) on one GGUF-typed weight
each, in one process: median time of a few-row product, the GB/s at which it reads the kernel's
packed bytes, its ratio to the last kernel named (the peer; default torch's int4) and to the
machine's memory-read bandwidth measured on the spot. A weight smaller than the last-level cache
(SmolLM2's 576x1536 down_proj, 0.55 MB as Q4_1) is read from cache after the first product, so its
GB/s can pass the DRAM figure; the 49152x576 lm_head (17.7 MB) cannot.

This file owns the command; the kernels live in model/quant/. It must never import torch at module
level (`rackserve --help` imports it) and never asserts a speed.
"""
from __future__ import annotations

import argparse
import json

from rackserve.serve.cli import register_subcommand


def random_weight(qtype: str, rows: int, cols: int, seed: int = 0):
    """Int4Groups of random GGUF blocks of `qtype` (random codes, scales and minimums of a real
    weight's size): quantizing a 28M-element weight with gguf-py would take longer than the bench."""
    import numpy as np

    from rackserve.model.quant.gguf_blocks import GROUP, from_gguf
    rng = np.random.default_rng(seed)
    head, size = {"Q4_0": (2, 18), "Q4_1": (4, 20), "Q8_0": (2, 34)}[qtype]
    blocks = rng.integers(0, 256, (rows, cols // GROUP, size), dtype=np.uint8)
    scales = (rng.standard_normal((rows, cols // GROUP, head // 2)) * 0.01).astype(np.float16)
    blocks[..., :head] = scales.view(np.uint8)
    return from_gguf(qtype, blocks.reshape(rows, -1))


def time_kernels(kernels: list[str], qtype: str, shape: tuple[int, int], rows: int, repeats: int) -> dict[str, dict]:
    """Per kernel: median seconds of `rows` x weight^T over `repeats` products, after one warm-up,
    the kernels alternating so that drift hits them alike; and the bytes each product reads."""
    import statistics
    import time

    import torch

    from rackserve.model.quant.quantized_linear import QUANT_KERNELS
    weight = random_weight(qtype, *shape)
    linears = {k: QUANT_KERNELS.get(k)(weight) for k in kernels}
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {k: [] for k in kernels}
    with torch.inference_mode():
        for linear in linears.values():
            linear(x)
        for _ in range(repeats):
            for k, linear in linears.items():
                t0 = time.perf_counter()
                linear(x)
                times[k].append(time.perf_counter() - t0)
    return {k: {"median_s": statistics.median(times[k]), "bytes": linears[k].weight_bytes_per_token()}
            for k in kernels}


def _add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kernels", default="vnni,avx2,int4",
                        help="quantized-linear kernels, comma-separated; the last is the peer of the ratios")
    parser.add_argument("--qtype", default="Q4_1", choices=["Q4_0", "Q4_1", "Q8_0"])
    parser.add_argument("--shapes", default="576x1536,49152x576",
                        help="weights as OUTxIN, comma-separated (default: SmolLM2's down_proj and lm_head)")
    parser.add_argument("--rows", type=int, default=1, help="rows of x (1: one decode token)")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=None, help="torch (and OpenMP) threads (default: torch's)")
    parser.add_argument("--output", default=None, help="write the results JSON here")


@register_subcommand("bench gemv", "quantized-linear kernels (vnni, avx2, int4) on one weight: GB/s, "
                     "ratios to a peer kernel and to the memory-read limit", _add_args)
def run_gemv(args: argparse.Namespace) -> None:
    import torch

    from rackserve.bench.limits import measure_limits
    from rackserve.bench.record import write_record
    kernels = args.kernels.split(",")
    if args.threads:
        torch.set_num_threads(args.threads)
    limits = measure_limits("cpu")
    print(f"machine: {limits.describe()}")
    results = []
    for spec in args.shapes.split(","):
        out_features, in_features = map(int, spec.lower().split("x"))
        timed = time_kernels(kernels, args.qtype, (out_features, in_features), args.rows, args.repeats)
        peer = timed[kernels[-1]]["median_s"]
        for k, t in timed.items():
            gbps = t["bytes"] / t["median_s"] / 1e9
            results.append({"kernel": k, "shape": [out_features, in_features], **t, "gb_s": gbps,
                            "speedup_vs_peer": peer / t["median_s"], "share_of_mem_read": gbps / limits.mem_read_gbps})
            print(f"{args.qtype} {out_features}x{in_features} {k:5s} {t['median_s'] * 1e6:9.1f} us "
                  f"{t['bytes'] / 1e6:7.2f} MB {gbps:7.1f} GB/s  {peer / t['median_s']:5.2f}x {kernels[-1]}  "
                  f"{gbps / limits.mem_read_gbps:5.0%} of memory read")
    result = {"bench": "gemv", "qtype": args.qtype, "rows": args.rows, "repeats": args.repeats,
              "threads": torch.get_num_threads(), "peer": kernels[-1], "limits": vars(limits), "results": results}
    if args.output:
        write_record(args.output, result)
    else:
        print(json.dumps(result, indent=2))
