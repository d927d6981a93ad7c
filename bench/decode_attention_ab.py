"""A/B of csrc/paged_decode_attention.cpp at one decode row, as a SmolLM2 step calls it: a side is a
git ref's kernel or a file (`@-DFLAG,...` adds compiler flags), compiled on its own for one ISA and
called through ctypes; each call takes the next of 30 layers' K/V caches (30 x the context's
bytes, more than the L2s: the step reads them from L3 or memory, not from the last call's
cache), the sides alternating round by round. Prints each side's median microseconds a call
(a layer), the GB/s of the K/V bytes it reads, its speed against the first side and max |side -
first side| of the outputs.

    python bench/decode_attention_ab.py --side main=main --side tree=rackserve/model/csrc/paged_decode_attention.cpp
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from rackserve.model import native
from rackserve.model.native_ops import _SIGNATURES

PATH = "rackserve/model/csrc/paged_decode_attention.cpp"
HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def build(spec: str, isa: str, tmp: str, label: str) -> ctypes.CDLL:
    source, _, defines = spec.partition("@")
    text = open(source).read() if os.path.isfile(source) else subprocess.run(
        ["git", "show", f"{source}:{PATH}"], capture_output=True, text=True, check=True).stdout
    src = os.path.join(tmp, f"{label}.cpp")
    with open(src, "w") as f:
        f.write(text)
    out = os.path.join(tmp, f"{label}.so")
    subprocess.run([native.compiler(), *native.CXX_FLAGS, *native.ISAS[isa].cxx_flags, "-I",
                    os.path.join(os.path.dirname(native.__file__), "csrc"), *[d for d in defines.split(",") if d],
                    src, "-o", out], check=True)
    lib = ctypes.CDLL(out)
    lib.rs_paged_decode_attention.argtypes = _SIGNATURES["rs_paged_decode_attention"]
    return lib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", action="append", required=True, help="LABEL=SOURCE[@-DFLAG,...]")
    parser.add_argument("--isa", default="avx2", choices=list(native.ISAS))
    parser.add_argument("--contexts", default="64,256,1024")
    parser.add_argument("--threads", default="2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=300, help="timed calls a side, context and round")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    load_before = os.getloadavg()
    g = torch.Generator().manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        libs = {}
        for spec in args.side:
            label, _, src = spec.partition("=")
            libs[label] = build(src, args.isa, tmp, label)
        for threads in [int(t) for t in args.threads.split(",")]:
            for ctx in [int(c) for c in args.contexts.split(",")]:
                n = ctx + 1
                blocks = -(-n // BLOCK)
                caches = [(torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g),
                           torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g)) for _ in range(LAYERS)]
                table = torch.arange(blocks, dtype=torch.int64)
                lens = torch.tensor([n], dtype=torch.int64)
                q = torch.randn(LAYERS, HEADS, HEAD_DIM, generator=g)
                nbytes = 2 * n * KV_HEADS * HEAD_DIM * 4
                times = {label: [] for label in libs}
                outs = {}
                for _ in range(args.rounds):
                    for label, lib in libs.items():
                        out = torch.empty(LAYERS, HEADS * HEAD_DIM)
                        for i in range(args.calls + LAYERS):
                            layer = i % LAYERS
                            k, v = caches[layer]
                            t0 = time.perf_counter()
                            lib.rs_paged_decode_attention(q[layer].data_ptr(), HEADS * HEAD_DIM, k.data_ptr(),
                                                          v.data_ptr(), table.data_ptr(), blocks, lens.data_ptr(), 1,
                                                          HEADS, KV_HEADS, HEAD_DIM, BLOCK, HEAD_DIM ** -0.5,
                                                          out[layer].data_ptr(), threads)
                            if i >= LAYERS:
                                times[label].append(time.perf_counter() - t0)
                        outs[label] = out
                first = next(iter(libs))
                base = statistics.median(times[first])
                for label, ts in times.items():
                    med = statistics.median(ts)
                    row = {"threads": threads, "context": ctx, "side": label, "median_us": med * 1e6,
                           "p10_us": sorted(ts)[len(ts) // 10] * 1e6, "kv_gbps": nbytes / med / 1e9,
                           "speed_over_first": base / med,
                           "max_abs_diff": float((outs[label] - outs[first]).abs().max())}
                    rows.append(row)
                    print(f"threads {threads} ctx {ctx:5d} {label:>8}: {row['median_us']:8.1f} us a layer "
                          f"(p10 {row['p10_us']:.1f}), K/V {row['kv_gbps']:5.1f} GB/s, {row['speed_over_first']:.2f}x "
                          f"{first}, max|diff| {row['max_abs_diff']:.1e}", flush=True)
    if args.output:
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                   platform.processor())
        with open(args.output, "w") as f:
            json.dump({"command": " ".join(sys.argv), "cpu": cpu, "isa": args.isa, "load_before": load_before,
                       "load_after": os.getloadavg(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
