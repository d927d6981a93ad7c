"""Ad hoc (issue 12, eighth round part I): two builds of csrc/vnni_gemv.cpp on SmolLM2's prefill steps,
in ONE process. The model loads once (this tree's code); before each step every VnniLinear's kernel is
pointed at build A (argv[1], e.g. main's library from ~/.cache/rackserve/kernels/) or at this tree's,
alternating A, B, A, B, so that drift and neighbours hit both alike. Only the GEMV differs between the
two: everything else in the step is this tree's.

    PYTHONPATH=$PWD python bench/vnni_prefill_step_ab.py MAIN.so [--pairs 6] [--output FILE]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time

import torch

from rackserve.bench.forward import build_setting
from rackserve.bench.forward_steps import ForwardPoint, RepeatedStep
from rackserve.bench.limits import processor_name
from rackserve.config import EngineArgs
from rackserve.model.native_ops import _SIGNATURES, load
from rackserve.model.quant.vnni_linear import VnniLinear


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("library_a", help="the other build's .so (its rs_vnni_gemv is side A)")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--context-lens", default="0,512")
    parser.add_argument("--output")
    args = parser.parse_args()
    lib_a = ctypes.CDLL(args.library_a)
    lib_a.rs_vnni_gemv.argtypes = _SIGNATURES["rs_vnni_gemv"]
    lib_a.rs_vnni_gemv.restype = ctypes.c_int
    kernels = {"A": lib_a.rs_vnni_gemv, "B": load("avx512").rs_vnni_gemv}
    points = [ForwardPoint("prefill", 1, int(c), 512) for c in args.context_lens.split(",")]
    setting = build_setting("B", EngineArgs(), None, points)
    ex = setting.executor
    linears = [m for m in ex.model.modules() if isinstance(m, VnniLinear)]
    load_before, results = os.getloadavg(), {}
    try:
        for p in points:
            steps = RepeatedStep(p, setting.config.cache.block_size, ex.vocab_size, 0)
            times: dict[str, list[float]] = {k: [] for k in kernels}
            for side in list(kernels) * (args.pairs + 1):
                for m in linears:
                    m._gemv = kernels[side]
                t0 = time.perf_counter()
                ex.execute_dp([steps.next()])
                times[side].append(time.perf_counter() - t0)
            ex.execute_dp([steps.retire()])
            timed = {k: v[1:] for k, v in times.items()}     # the first pair warms up
            med = {k: statistics.median(v) * 1e3 for k, v in timed.items()}
            results[f"context {p.context_len}"] = {"median_ms": med, "a_over_b": med["A"] / med["B"],
                                                   "steps_ms": {k: [round(x * 1e3, 1) for x in v] for k, v in timed.items()}}
            print(f"512 new tokens, context {p.context_len}: A {med['A']:.1f} ms, B {med['B']:.1f} ms, "
                  f"A/B {med['A'] / med['B']:.3f}", flush=True)
    finally:
        ex.shutdown()
    record = {"bench": "vnni prefill step A/B (ad hoc)", "library_a": os.path.basename(args.library_a),
              "library_b": os.path.basename(load("avx512")._name), "vnni_linears": len(linears),
              "threads": torch.get_num_threads(), "cpu": processor_name(), "load_before": load_before,
              "load_after": os.getloadavg(), "results": results}
    if args.output:
        with open(args.output, "w") as f:
            json.dump(record, f, indent=1)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
