"""A/B micro-benchmark of csrc/avx2_gemv.cpp at prefill rows (issue 12, ninth round, the first Zen 3):
the kernel of a git ref (default main) against the working tree's (or --b-file's), each compiled on
its own with the avx2 build's flags, called through ctypes on SmolLM2's four Q4_1 weights (random
GGUF blocks packed as quant/avx2_linear.py packs them; --qtype and --shapes for others, as its Q8_0 lm_head), and torch's fp32 GEMM of the same weight
already dequantized ("dense"; and the dequantization a dense call also pays, timed on its own),
alternately A B dense, in one process. Prints each case's medians and GFLOP/s (2 rows out in
flops), and writes the rows to --output as JSON with the CPU and the load.

    python bench/avx2_gemm_ab.py --ref main --rows 16,64,256,512 --output bench/results/x.json
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

import numpy as np
import torch
import torch.nn.functional as F

from rackserve.cpu_dtype import cpu_identity
from rackserve.model import native
from rackserve.model.native_ops import _SIGNATURES
from rackserve.model.quant.avx2_linear import Avx2Linear
from rackserve.model.quant.gguf_blocks import from_gguf

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]   # (out, in): qkv, o, gate_up, down
PATH = "rackserve/model/csrc/avx2_gemv.cpp"


def build(source_text: str, out_dir: str, name: str) -> ctypes.CDLL:
    csrc = os.path.join(os.path.dirname(native.__file__), "csrc")
    src = os.path.join(out_dir, name + ".cpp")
    with open(src, "w") as f:
        f.write(source_text)
    lib = os.path.join(out_dir, name + ".so")
    subprocess.run([native.compiler(), *native.CXX_FLAGS, *native.ISAS["avx2"].cxx_flags, "-I", csrc, src, "-o", lib],
                   check=True)
    handle = ctypes.CDLL(lib)
    handle.rs_avx2_gemv.argtypes = _SIGNATURES["rs_avx2_gemv"]
    handle.rs_avx2_gemv.restype = ctypes.c_int
    return handle


KINDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}


def random_linear(out: int, k: int, qtype: str = "Q4_1") -> Avx2Linear:
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize
    w = np.random.default_rng(out * k).standard_normal((out, k)).astype(np.float32) * 0.05 + 0.01
    return Avx2Linear(from_gguf(qtype, quantize(w, Q[qtype])))


def timed(call, seconds: float) -> list[float]:
    call()
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", default="main", help="git ref of the A side's kernel")
    parser.add_argument("--a-file", default=None, help="the A side's kernel from this file instead of --ref")
    parser.add_argument("--b-file", default=None, help="the B side's kernel from this file instead of the tree's")
    parser.add_argument("--threads", default="2")
    parser.add_argument("--rows", default="16,32,64,128,256,512")
    parser.add_argument("--shapes", default=None, help="OUTxIN,... (default: SmolLM2's four)")
    parser.add_argument("--pairs", type=int, default=2, help="alternating A B dense rounds")
    parser.add_argument("--seconds", type=float, default=0.3, help="per case, side and round")
    parser.add_argument("--qtype", default="Q4_1", choices=list(KINDS), help="the weights' GGUF type (Q8_0: an lm_head)")
    parser.add_argument("--no-dense", action="store_true")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    if args.a_file:
        with open(args.a_file) as f:
            old = f.read()
    else:
        old = subprocess.run(["git", "show", f"{args.ref}:{PATH}"], capture_output=True, text=True, check=True).stdout
    with open(args.b_file or PATH) as f:
        new = f.read()
    shapes = SHAPES if args.shapes is None else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    load_before = os.getloadavg()
    rows_out = []
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"A": build(old, tmp, "a"), "B": build(new, tmp, "b")}
        for threads in [int(t) for t in args.threads.split(",")]:
            torch.set_num_threads(threads)
            for out, k in shapes:
                lin = random_linear(out, k, args.qtype)
                tiles = lin.packed.shape[0]
                w = lin.dequantize()
                deq_ms = sorted(timed(lin.dequantize, args.seconds))
                deq_ms = deq_ms[len(deq_ms) // 2] * 1e3
                for n in [int(r) for r in args.rows.split(",")]:
                    x = torch.randn(n, k)
                    x[:, 5] *= 20
                    ys = {s: torch.empty(n, tiles * 8) for s in libs}
                    calls = {s: (lambda lib=lib, y=ys[s]: lib.rs_avx2_gemv(x.data_ptr(), n, k, lin.packed.data_ptr(), tiles, KINDS[args.qtype],
                                                                         y.data_ptr(), threads)) for s, lib in libs.items()}
                    if not args.no_dense:
                        calls["dense"] = lambda: F.linear(x, w)
                    times = {s: [] for s in calls}
                    for _ in range(args.pairs):
                        for s, call in calls.items():
                            times[s] += timed(call, args.seconds)
                    ref = x.double() @ w.double().T
                    err = {s: float(((y[:, :out].double() - ref).abs().amax(-1) / ref.abs().amax(-1)).max()) for s, y in ys.items()}
                    med = {s: sorted(ts)[len(ts) // 2] for s, ts in times.items()}
                    gf = {s: 2 * n * out * k / t / 1e9 for s, t in med.items()}
                    row = {"threads": threads, "out": out, "in": k, "rows": n,
                           "median_ms": {s: t * 1e3 for s, t in med.items()}, "gflops": gf,
                           "b_over_a_speed": med["A"] / med["B"], "dequantize_ms": deq_ms,
                           "max_rel_err": err, "calls": {s: len(ts) for s, ts in times.items()}}
                    if "dense" in med:
                        row["b_over_dense_speed"] = med["dense"] / med["B"]
                        row["b_over_dense_with_dequantize"] = (med["dense"] + deq_ms / 1e3) / med["B"]
                    rows_out.append(row)
                    dense = (f"  dense {gf['dense']:6.1f} (+deq {deq_ms:.2f} ms)  B/dense {row['b_over_dense_speed']:.2f}x"
                             if "dense" in gf else "")
                    print(f"th {threads} {out:5d}x{k:<5d} rows {n:4d}: A {gf['A']:6.1f}  B {gf['B']:6.1f} GFLOP/s  "
                          f"B/A {row['b_over_a_speed']:.2f}x{dense}  err A {err['A']:.1e} B {err['B']:.1e}", flush=True)
    if args.output:
        cpu = cpu_identity()
        with open(args.output, "w") as f:
            json.dump({"command": " ".join(sys.argv), "cpu": cpu, "ref": args.ref, "a_file": args.a_file,
                       "b_file": args.b_file, "load_before": load_before, "load_after": os.getloadavg(),
                       "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
