"""A/B of csrc/paged_decode_attention.cpp at a step of decode rows (--batch, each its own context),
as a SmolLM2 step calls it: a side is a git ref's kernel or a file (`@-DFLAG,...` adds compiler
flags), compiled on its own for one ISA and called through ctypes, over each --kv-dtypes cache
(float16, fp8e4m3, fp8e5m2: the same values rounded, read by rs_paged_decode_attention_f16 / _fp8e4m3 /
_fp8e5m2); each call takes the next
of at least 30 layers' K/V caches (and at least 64 MB of float16 ones, more than the L2s and L3s:
the step reads them from memory, as a step whose GEMVs stream the weights between layers does,
not from the last call's cache), the sides alternating round by round. Prints
each side's median microseconds a call (a layer), the GB/s of the K/V bytes it reads, its speed
against the first side and max |side - first side| of the outputs.

    python bench/decode_attention_ab.py --side main=main --side tree=rackserve/model/csrc/paged_decode_attention.cpp
    python bench/decode_attention_ab.py --side tree=rackserve/model/csrc/paged_decode_attention.cpp \
        --kv-dtypes float32,float16 --batch 1,8 --contexts 256,1024,4096
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from rackserve.cpu_dtype import cpu_identity
from rackserve.model import native
from rackserve.model.native_ops import _SIGNATURES

PATH = "rackserve/model/csrc/paged_decode_attention.cpp"
# Each --kv-dtypes name: its entry point, the torch dtype its values are rounded to, and bytes a value.
ENTRY = {"float32": "rs_paged_decode_attention", "float16": "rs_paged_decode_attention_f16",
         "fp8e4m3": "rs_paged_decode_attention_fp8e4m3", "fp8e5m2": "rs_paged_decode_attention_fp8e5m2"}
DTYPE = {"float32": torch.float32, "float16": torch.float16, "fp8e4m3": torch.float8_e4m3fn,
         "fp8e5m2": torch.float8_e5m2}
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
    for name in ENTRY.values():
        if hasattr(lib, name):
            getattr(lib, name).argtypes = _SIGNATURES[name]
    return lib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", action="append", required=True, help="LABEL=SOURCE[@-DFLAG,...]")
    parser.add_argument("--isa", default="avx2", choices=list(native.ISAS))
    parser.add_argument("--contexts", default="64,256,1024")
    parser.add_argument("--threads", default="2")
    parser.add_argument("--batch", default="1", help="decode rows a call, comma-separated")
    parser.add_argument("--kv-dtypes", default="float32", help="cache dtypes each side runs over, of " + ",".join(ENTRY))
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
        dtypes = args.kv_dtypes.split(",")
        sides = {(f"{label}/{dt}" if len(dtypes) > 1 else label): (getattr(lib, ENTRY[dt]), dt)
                 for label, lib in libs.items() for dt in dtypes}
        for threads, batch, ctx in [(int(t), int(b), int(c)) for t in args.threads.split(",")
                                    for b in args.batch.split(",") for c in args.contexts.split(",")]:
            n = ctx + 1
            blocks = -(-n // BLOCK)
            layer_bytes = 2 * batch * blocks * BLOCK * KV_HEADS * HEAD_DIM * 2    # of the float16 cache
            layers = int(max(LAYERS, -(-64e6 // layer_bytes)))
            f32 = [(torch.randn(batch * blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g),
                    torch.randn(batch * blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g)) for _ in range(layers)]
            caches = {"float32": f32} if "float32" in dtypes else {}
            for dt in dtypes:
                if dt != "float32":
                    caches[dt] = [(k.to(DTYPE[dt]), v.to(DTYPE[dt])) for k, v in f32]
            if "float32" not in dtypes:
                del f32
            table = torch.arange(batch * blocks, dtype=torch.int64)     # row r: blocks r * blocks ...
            lens = torch.full((batch,), n, dtype=torch.int64)
            q = torch.randn(layers, batch, HEADS, HEAD_DIM, generator=g)
            times = {label: [] for label in sides}
            outs = {}
            for _ in range(args.rounds):
                for label, (fn, dt) in sides.items():
                    out = torch.empty(layers, batch, HEADS * HEAD_DIM)
                    for i in range(args.calls + layers):
                        layer = i % layers
                        k, v = caches[dt][layer]
                        t0 = time.perf_counter()
                        fn(q[layer].data_ptr(), HEADS * HEAD_DIM, k.data_ptr(), v.data_ptr(), table.data_ptr(),
                           blocks, lens.data_ptr(), batch, HEADS, KV_HEADS, HEAD_DIM, BLOCK, HEAD_DIM ** -0.5,
                           out[layer].data_ptr(), threads)
                        if i >= layers:
                            times[label].append(time.perf_counter() - t0)
                    outs[label] = out
            first = next(iter(sides))
            base = statistics.median(times[first])
            for label, ts in times.items():
                med = statistics.median(ts)
                nbytes = 2 * batch * n * KV_HEADS * HEAD_DIM * DTYPE[sides[label][1]].itemsize
                row = {"threads": threads, "batch": batch, "context": ctx, "side": label,
                       "kv_dtype": sides[label][1], "layers": layers, "median_us": med * 1e6,
                       "p10_us": sorted(ts)[len(ts) // 10] * 1e6, "kv_gbps": nbytes / med / 1e9,
                       "speed_over_first": base / med,
                       "max_abs_diff": float((outs[label] - outs[first]).abs().max())}
                rows.append(row)
                print(f"threads {threads} batch {batch} ctx {ctx:5d} {label:>8}: {row['median_us']:8.1f} us a layer "
                      f"(p10 {row['p10_us']:.1f}), K/V {row['kv_gbps']:5.1f} GB/s, {row['speed_over_first']:.2f}x "
                      f"{first}, max|diff| {row['max_abs_diff']:.1e}", flush=True)
    if args.output:
        cpu = cpu_identity()
        with open(args.output, "w") as f:
            json.dump({"command": " ".join(sys.argv), "cpu": cpu, "isa": args.isa, "load_before": load_before,
                       "load_after": os.getloadavg(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
