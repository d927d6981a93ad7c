"""A/B of the native decode step's code (csrc/: the GEMV, attention, fused ops, decode loop) in one
process on one model: side A is the library of the tree on PYTHONPATH, each other side a csrc
directory (a git ref's, or a path; `@-DFLAG,...` adds compiler flags) built for the same ISA, and
the sides' decode steps alternate A, B, A, B ... through the real execute path (the step `bench
forward --mode decode` times). A side's steps run its rs_decode_layers with its GEMV in every
layer and for the lm_head. Prints each side's median step and its ratio to A, then each side's
split of the native step by op (decode_loop.cpp's clock, from separate profiled steps), and the
token each side sampled (greedy: the same on every side unless the numerics moved).

    PYTHONPATH=. python bench/native_decode_step_ab.py --side main=main --batch-sizes 1 \
        --context-lens 256,1024 --output bench/results/x.json
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from rackserve.bench.forward import build_setting
from rackserve.bench.forward_steps import ForwardPoint, RepeatedStep, group_block_sizes
from rackserve.bench.limits import processor_name
from rackserve.config import EngineArgs
from rackserve.model import native, native_decode
from rackserve.model.native_ops import _SIGNATURES

GEMV_FN = {"avx512": "rs_vnni_gemv", "avx2": "rs_avx2_gemv"}


def build_side(spec: str, isa: str, tmp: str, label: str) -> ctypes.CDLL:
    """SOURCE[@FLAG,...]: SOURCE a csrc directory or a git ref (its rackserve/model/csrc)."""
    source, _, defines = spec.partition("@")
    if os.path.isdir(source):
        csrc = source
    else:
        root = os.path.join(tmp, label)
        os.makedirs(root)
        archive = subprocess.run(["git", "archive", source, "rackserve/model/csrc"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", root], input=archive.stdout, check=True)
        csrc = os.path.join(root, "rackserve/model/csrc")
    others = {i.gemv for name, i in native.ISAS.items() if name != isa}
    srcs = [s for s in sorted(glob.glob(os.path.join(csrc, "*.cpp"))) if os.path.basename(s) not in others]
    out = os.path.join(tmp, f"{label}.so")
    subprocess.run([native.compiler(), *native.CXX_FLAGS, *native.ISAS[isa].cxx_flags,
                    *[d for d in defines.split(",") if d], *srcs, "-o", out], check=True)
    lib = ctypes.CDLL(out)
    for name, args in _SIGNATURES.items():
        if hasattr(lib, name):
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = ctypes.c_int
    return lib


def side_decoder(model, lib: ctypes.CDLL, isa: str) -> native_decode.NativeDecoder:
    """A NativeDecoder of `model` whose step calls `lib`'s decode loop and GEMV."""
    dec = native_decode.NativeDecoder(model)
    gemv = ctypes.cast(getattr(lib, GEMV_FN[isa]), ctypes.c_void_p).value
    for layer in dec._layers:
        for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
            linear.gemv = gemv
    fn = lib.rs_decode_layers
    fn.argtypes, fn.restype = dec.lib.rs_decode_layers.argtypes, ctypes.c_int
    dec.lib = lib
    return dec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", action="append", required=True, help="LABEL=SOURCE[@-DFLAG,...], sides B, C, ...")
    parser.add_argument("--native-isa", default="avx2", choices=list(native.ISAS))
    parser.add_argument("--batch-sizes", default="1")
    parser.add_argument("--context-lens", default="256,1024")
    parser.add_argument("--seconds", type=float, default=3.0, help="timed seconds a side and point")
    parser.add_argument("--profile-steps", type=int, default=20, help="profiled steps a side and point, after")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    points = [ForwardPoint("decode", int(b), int(c), 1) for b in args.batch_sizes.split(",")
              for c in args.context_lens.split(",")]
    setting = build_setting("A", EngineArgs(native_isa=args.native_isa), None, points)
    executor = setting.executor
    runner, model = executor.runner, executor.model
    lm = model.lm_head.quant
    assert runner.native_decoder is not None, "the native decode step is off for this model"
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"A": (runner.native_decoder, lm._gemv, "PYTHONPATH's tree")}
        for spec in args.side:
            label, _, src = spec.partition("=")
            lib = build_side(src, args.native_isa, tmp, label)
            gemv = getattr(lib, GEMV_FN[args.native_isa])
            sides[label] = (side_decoder(model, lib, args.native_isa), gemv, src)

        def use(label: str) -> None:
            runner.native_decoder, lm._gemv = sides[label][0], sides[label][1]

        try:
            for point in points:
                step = RepeatedStep(point, setting.config.cache.block_size, executor.vocab_size, 0, (0, 1),
                                    group_block_sizes(executor.kv_cache_config))
                times = {label: [] for label in sides}
                tokens = {}
                for label in sides:     # warm-up
                    use(label)
                    for _ in range(3):
                        executor.execute_dp([step.next()])
                while min(sum(t) for t in times.values()) < args.seconds:
                    for label in sides:
                        use(label)
                        t0 = time.perf_counter()
                        out = executor.execute_dp([step.next()])
                        times[label].append(time.perf_counter() - t0)
                        tokens[label] = out[0].sampled_token_ids
                ops = {}
                for label, (dec, _, _) in sides.items():
                    use(label)
                    dec.profile(True)
                    for _ in range(args.profile_steps):
                        executor.execute_dp([step.next()])
                    ops[label] = {op: s / args.profile_steps * 1e3 for op, s in zip(native_decode.OPS, dec.seconds)}
                    dec.profile(False)
                executor.execute_dp([step.retire()])
                base = statistics.median(times["A"])
                for label, ts in times.items():
                    med = statistics.median(ts)
                    row = {"batch_size": point.batch_size, "context_len": point.context_len, "side": label,
                           "source": sides[label][2], "steps": len(ts), "median_ms": med * 1e3,
                           "p10_ms": sorted(ts)[len(ts) // 10] * 1e3, "p90_ms": sorted(ts)[len(ts) * 9 // 10] * 1e3,
                           "speed_over_a": base / med, "native_op_ms": ops[label], "sampled": tokens[label],
                           "load": os.getloadavg()[0]}
                    rows.append(row)
                    print(f"b{point.batch_size} ctx {point.context_len} {label:>8}: median {row['median_ms']:7.3f} ms "
                          f"(p10 {row['p10_ms']:.3f}, p90 {row['p90_ms']:.3f}, {len(ts)} steps)  "
                          f"{row['speed_over_a']:.3f}x A's speed  sampled {tokens[label]}", flush=True)
                    print("      native ops, ms a step: " + ", ".join(f"{k} {v:.3f}" for k, v in ops[label].items()),
                          flush=True)
        finally:
            use("A")
            executor.shutdown()
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"command": " ".join(sys.argv), "cpu": processor_name("cpu"), "machine": platform.machine(),
                       "native_isa": args.native_isa, "threads": torch.get_num_threads(),
                       "sides": {k: v[2] for k, v in sides.items()}, "load_before": load_before,
                       "load_after": os.getloadavg(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
