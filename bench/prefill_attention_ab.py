"""A/B micro-benchmark of csrc/prefill_attention.cpp: the kernel of a git ref (default main) against
the working tree's, each compiled on its own with the native library's flags for one ISA, called
through ctypes on the same random SmolLM2-shaped tensors (9 heads, 3 KV heads, head_dim 64, block
16, a scattered block table), alternately A B A B. Prints each case's medians, GFLOP/s (the exact
causal multiply-adds of scores and values) and B/A, and writes the rows to --output as JSON.

    python bench/prefill_attention_ab.py --ref main --isa avx512 --output bench/results/x.json
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from rackserve.cpu_dtype import cpu_identity
from rackserve.model import native
from rackserve.model.native_ops import _SIGNATURES

CASES = [(16, 0), (16, 1024), (16, 2048), (32, 0), (32, 1024), (32, 2048), (128, 1024), (512, 0), (512, 1024)]   # (new tokens, context)
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def build(source_text: str, isa: str, out_dir: str, name: str) -> ctypes.CDLL:
    csrc = os.path.join(os.path.dirname(native.__file__), "csrc")
    src = os.path.join(out_dir, name + ".cpp")
    with open(src, "w") as f:
        f.write(source_text)
    lib = os.path.join(out_dir, name + ".so")
    subprocess.run([native.compiler(), *native.CXX_FLAGS, *native.ISAS[isa].cxx_flags, "-I", csrc, src, "-o", lib],
                   check=True)
    handle = ctypes.CDLL(lib)
    handle.rs_prefill_attention.argtypes = _SIGNATURES["rs_prefill_attention"]
    return handle


def flops(n: int, ctx: int) -> float:
    keys = sum(ctx + i + 1 for i in range(n))           # (query, key) pairs causally seen
    return 2 * 2 * keys * HEADS * HEAD_DIM              # scores and values: a multiply-add each


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", default="main", help="git ref of the A side's kernel")
    parser.add_argument("--a-file", default=None, help="the A side's kernel from this file instead of --ref")
    parser.add_argument("--isa", default="avx512", choices=list(native.ISAS))
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--pairs", type=int, default=2, help="alternating A B rounds")
    parser.add_argument("--seconds", type=float, default=0.6, help="per case, side and round")
    parser.add_argument("--cases", default=None, help="new_tokens:context,... (default: all of CASES)")
    parser.add_argument("--build-dir", default=None, help="keep the two libraries here (for perf annotate)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    path = "rackserve/model/csrc/prefill_attention.cpp"
    if args.a_file:
        with open(args.a_file) as f:
            old = f.read()
    else:
        old = subprocess.run(["git", "show", f"{args.ref}:{path}"], capture_output=True, text=True, check=True).stdout
    with open(path) as f:
        new = f.read()
    load_before = os.getloadavg()
    torch.manual_seed(0)
    k = torch.randn(1024, BLOCK, KV_HEADS, HEAD_DIM)
    v = torch.randn(1024, BLOCK, KV_HEADS, HEAD_DIM)
    table = torch.randperm(1024)[:200].to(torch.int64).contiguous()
    cases = CASES if args.cases is None else [tuple(int(x) for x in c.split(":")) for c in args.cases.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.build_dir or scratch
        libs = {"A": build(old, args.isa, tmp, "a"), "B": build(new, args.isa, tmp, "b")}
        for threads in [int(t) for t in args.threads.split(",")]:
            for n, ctx in cases:
                q = torch.randn(n, HEADS, HEAD_DIM)
                outs, times = {}, {"A": [], "B": []}
                for _ in range(args.pairs):
                    for side, lib in libs.items():
                        out = torch.empty(n, HEADS * HEAD_DIM)
                        call = lambda: lib.rs_prefill_attention(   # noqa: E731
                            q.data_ptr(), q.stride(0), n, ctx, k.data_ptr(), v.data_ptr(), table.data_ptr(), HEADS,
                            KV_HEADS, HEAD_DIM, BLOCK, 0.125, out.data_ptr(), threads)
                        call()
                        end = time.perf_counter() + args.seconds
                        while time.perf_counter() < end:
                            t = time.perf_counter()
                            call()
                            times[side].append(time.perf_counter() - t)
                        outs[side] = out
                diff = (outs["A"] - outs["B"]).abs().max().item()
                med = {s: sorted(ts)[len(ts) // 2] for s, ts in times.items()}
                row = {"threads": threads, "new_tokens": n, "context": ctx, "median_ms_a": med["A"] * 1e3,
                       "median_ms_b": med["B"] * 1e3, "gflops_a": flops(n, ctx) / med["A"] / 1e9,
                       "gflops_b": flops(n, ctx) / med["B"] / 1e9, "b_over_a_speed": med["A"] / med["B"],
                       "max_abs_diff": diff, "calls": {s: len(ts) for s, ts in times.items()}}
                rows.append(row)
                print(f"threads {threads} n={n:4d} ctx={ctx:5d}: A {row['median_ms_a']:8.3f} ms "
                      f"({row['gflops_a']:5.1f} GFLOP/s)  B {row['median_ms_b']:8.3f} ms ({row['gflops_b']:5.1f})  "
                      f"B/A speed {row['b_over_a_speed']:.2f}x  max|A-B| {diff:.1e}", flush=True)
    if args.output:
        cpu = cpu_identity()
        with open(args.output, "w") as f:
            json.dump({"command": " ".join(sys.argv), "cpu": cpu, "isa": args.isa, "ref": args.ref,
                       "load_before": load_before,
                       "load_after": os.getloadavg(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
