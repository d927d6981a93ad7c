"""A/B of the avx2 build's one-row GEMV (csrc/avx2_gemv.cpp) on a batch-1 decode step's weights:
each side's avx2_gemv.cpp (a git ref's, a file, or the working tree's, with optional -D flags) is
compiled on its own with the native library's avx2 flags, and bench/gemv_step.cpp times the 121
GEMVs of a SmolLM2-135M step (30 x Q4_1 qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536,
and the Q8_0 lm_head 49152x576, each its own buffer: 96.4 MB, more than a Zen 3's 32 MB L3) back to
back, then a plain AVX2 read of the same bytes, the sides alternating round by round. Prints each
side's median step, its GB/s and its ratio to the plain read of the same round, and each side's
largest output difference to the first side's (0 where the numerics are the same).

    python bench/avx2_decode_gemv_ab.py --side main=main --side tree=tree \
        --side pf8k=tree@-DRS_AVX2_PREFETCH=8192 --output bench/results/x.json
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

import numpy as np

from rackserve.cpu_dtype import cpu_identity
from rackserve.model import native

CSRC = os.path.join(os.path.dirname(native.__file__), "csrc")
GEMV_PATH = "rackserve/model/csrc/avx2_gemv.cpp"
HEADER_PATH = "rackserve/model/csrc/quantized_rows.h"
TILE = 8
REC = {1: 160, 2: 272}             # bytes a tile-block record: Q4_1, Q8_0 (avx2_gemv.cpp)
CODE_BYTES = {1: 128, 2: 256}
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]   # qkv, o, gate_up, down (out, in)
LM_HEAD = (49152, 576)


def side_source(spec: str, tmp: str, label: str) -> tuple[str, list[str]]:
    """(directory holding the side's avx2_gemv.cpp and quantized_rows.h, its -D flags) for
    SOURCE[@FLAG,FLAG...]: SOURCE is "tree", a file, or a git ref."""
    source, _, defines = spec.partition("@")
    flags = [d for d in defines.split(",") if d]
    if source == "tree":
        return CSRC, flags
    d = os.path.join(tmp, f"src-{label}")
    os.makedirs(d)
    if os.path.isfile(source):
        gemv, header = open(source).read(), open(os.path.join(CSRC, "quantized_rows.h")).read()
    else:
        show = lambda p: subprocess.run(["git", "show", f"{source}:{p}"], capture_output=True, text=True,  # noqa: E731
                                        check=True).stdout
        gemv, header = show(GEMV_PATH), show(HEADER_PATH)
    for name, text in (("avx2_gemv.cpp", gemv), ("quantized_rows.h", header)):
        with open(os.path.join(d, name), "w") as f:
            f.write(text)
    return d, flags


def build(sources: list[str], flags: list[str], out: str) -> ctypes.CDLL:
    cmd = [native.compiler(), *native.CXX_FLAGS, *native.ISAS["avx2"].cxx_flags, *flags, *sources, "-o", out]
    subprocess.run(cmd, check=True)
    return ctypes.CDLL(out)


def weights(rng: np.random.Generator) -> list[tuple[np.ndarray, int, int, int]]:
    """(packed bytes, tiles, k, kind) of a step's weights: random codes, fp16 scales ~0.01."""
    shapes = [(n, k, 1) for _ in range(30) for n, k in LAYER] + [(*LM_HEAD, 2)]
    out = []
    for n, k, kind in shapes:
        tiles, nb = n // TILE, k // 32
        b = rng.integers(0, 256, (tiles, nb, REC[kind]), dtype=np.uint8)
        scales = (rng.standard_normal((tiles, nb, (REC[kind] - CODE_BYTES[kind]) // 2)) * 0.01).astype(np.float16)
        b[..., CODE_BYTES[kind]:] = scales.view(np.uint8)
        out.append((np.ascontiguousarray(b), tiles, k, kind))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", action="append", required=True,
                        help="LABEL=SOURCE[@-DFLAG,...]: SOURCE tree, a git ref or a file; the first is the base")
    parser.add_argument("--threads", default="2,1")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of all sides")
    parser.add_argument("--steps", type=int, default=25, help="timed steps a side and round")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    load_before = os.getloadavg()
    rng = np.random.default_rng(0)
    ws = weights(rng)
    count = len(ws)
    ptrs = (ctypes.c_void_p * count)(*[w[0].ctypes.data for w in ws])
    tiles = (ctypes.c_int64 * count)(*[w[1] for w in ws])
    ks = (ctypes.c_int64 * count)(*[w[2] for w in ws])
    kinds = (ctypes.c_int * count)(*[w[3] for w in ws])
    nbytes = (ctypes.c_int64 * count)(*[w[0].nbytes for w in ws])
    total = sum(w[0].nbytes for w in ws)
    x = rng.standard_normal(max(LAYER[3][1], LM_HEAD[1])).astype(np.float32)
    y = np.zeros(LM_HEAD[0], dtype=np.float32)
    sink = ctypes.c_int64()
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        harness = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gemv_step.cpp")
        sides = {}
        for spec in args.side:
            label, _, src = spec.partition("=")
            d, flags = side_source(src, tmp, label)
            lib = build([os.path.join(d, "avx2_gemv.cpp"), harness], ["-I", d, *flags], os.path.join(tmp, f"{label}.so"))
            step, read = lib.rs_bench_gemv_step, lib.rs_bench_plain_read
            step.restype = read.restype = ctypes.c_double
            step.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
            read.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
            sides[label] = (lib, ctypes.cast(lib.rs_avx2_gemv, ctypes.c_void_p).value, spec)
        # Bit-for-bit: every side's outputs for every weight against the first side's.
        ref_out, mismatch = None, {}
        for label, (lib, fn, _) in sides.items():
            lib.rs_avx2_gemv.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                         ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
            outs = []
            for w, t, k, kind in ws[:4] + ws[-1:]:
                out = np.zeros(t * TILE, dtype=np.float32)
                assert lib.rs_avx2_gemv(x.ctypes.data, 1, k, w.ctypes.data, t, kind, out.ctypes.data, 2) == 0
                outs.append(out)
            if ref_out is None:
                ref_out = outs
            mismatch[label] = max(float(np.abs(a - b).max()) for a, b in zip(outs, ref_out))
        print("max |side - first side| over qkv, o, gate_up, down, lm_head:", mismatch, flush=True)
        for threads in [int(t) for t in args.threads.split(",")]:
            times = {label: {"step": [], "read": []} for label in sides}
            for r in range(args.rounds):
                for label, (lib, fn, _) in sides.items():
                    for _ in range(2):
                        lib.rs_bench_gemv_step(fn, ptrs, tiles, ks, kinds, count, x.ctypes.data, y.ctypes.data, threads)
                    for _ in range(args.steps):
                        times[label]["step"].append(lib.rs_bench_gemv_step(fn, ptrs, tiles, ks, kinds, count,
                                                                           x.ctypes.data, y.ctypes.data, threads))
                        times[label]["read"].append(lib.rs_bench_plain_read(ptrs, nbytes, count, threads,
                                                                            ctypes.byref(sink)))
                    s = times[label]["step"][-args.steps:]
                    p = times[label]["read"][-args.steps:]
                    med, rmed = statistics.median(s), statistics.median(p)
                    row = {"threads": threads, "round": r, "side": label, "median_step_ms": med * 1e3,
                           "p10_step_ms": sorted(s)[len(s) // 10] * 1e3, "gbps": total / med / 1e9,
                           "plain_read_ms": rmed * 1e3, "plain_read_gbps": total / rmed / 1e9,
                           "of_plain_read": rmed / med, "load": os.getloadavg()[0]}
                    rows.append(row)
                    print(f"threads {threads} round {r} {label:>10}: step {row['median_step_ms']:7.3f} ms "
                          f"(p10 {row['p10_step_ms']:7.3f}, {row['gbps']:5.1f} GB/s)  plain read "
                          f"{row['plain_read_ms']:7.3f} ms ({row['plain_read_gbps']:5.1f} GB/s)  "
                          f"{row['of_plain_read']:.2f}x of it  load {row['load']:.2f}", flush=True)
            base = next(iter(sides))
            results[threads] = {label: {"median_step_ms": statistics.median(v["step"]) * 1e3,
                                        "median_read_ms": statistics.median(v["read"]) * 1e3} for label, v in times.items()}
            for label, v in results[threads].items():
                print(f"threads {threads} {label:>10}: all rounds median step {v['median_step_ms']:.3f} ms, "
                      f"{results[threads][base]['median_step_ms'] / v['median_step_ms']:.3f}x {base}'s speed, "
                      f"plain read {v['median_read_ms']:.3f} ms", flush=True)
    if args.output:
        cpu = cpu_identity()
        with open(args.output, "w") as f:
            json.dump({"command": " ".join(sys.argv), "cpu": cpu, "bytes_a_step": total,
                       "sides": {label: spec for label, (_, _, spec) in sides.items()}, "max_abs_diff": mismatch,
                       "load_before": load_before, "load_after": os.getloadavg(), "summary": results, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
