"""A/B of two builds of csrc/avx2_gemv.cpp on SmolLM2's steps in ONE process (issue 12, ninth round,
the first Zen 3), as bench/vnni_prefill_step_ab.py does for the vnni kernel. The model loads once
(this tree's code, --quant-kernel avx2); before each step every Avx2Linear is pointed at side A (a
git ref's kernel, default main, with --a-dense-above-rows, main's 256) or side B (this tree's, with
its class's dense_above_rows), alternating A, B, A, B, so that drift and neighbours hit both alike.
Only the quantized linears differ between the two: everything else in the step is this tree's.
Prefill steps only: a decode step runs in the native decode loop, which took the GEMV's address
at load (model/native_decode.py), so switching `_gemv` would not reach it.

    PYTHONPATH=$PWD python bench/avx2_prefill_step_ab.py --ref main --points 1:0:512 --output FILE
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time

import torch

from bench.avx2_gemm_ab import PATH, build
from rackserve.bench.forward import build_setting
from rackserve.bench.forward_steps import ForwardPoint, RepeatedStep
from rackserve.bench.limits import processor_name
from rackserve.config import EngineArgs
from rackserve.model.quant.avx2_linear import Avx2Linear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", default="main", help="git ref of the A side's kernel")
    parser.add_argument("--a-dense-above-rows", type=int, default=256, help="side A's dense threshold (main's)")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--points", default="1:0:512,1:1024:512,1:0:256,4:0:64",
                        help="batch:context:new_tokens,... (prefill steps)")
    parser.add_argument("--output")
    args = parser.parse_args()
    old = subprocess.run(["git", "show", f"{args.ref}:{PATH}"], capture_output=True, text=True, check=True).stdout
    points = [ForwardPoint("prefill", int(b), int(c), int(n)) for b, c, n in (p.split(":") for p in args.points.split(","))]
    load_before, results = os.getloadavg(), {}
    with tempfile.TemporaryDirectory() as tmp:
        lib_a = build(old, tmp, "a")
        setting = build_setting("B", EngineArgs(quant_kernel="avx2"), None, points)
        ex = setting.executor
        linears = [m for m in ex.model.modules() if isinstance(m, Avx2Linear)]
        sides = {"A": (lib_a.rs_avx2_gemv, args.a_dense_above_rows), "B": (linears[0]._gemv, Avx2Linear.dense_above_rows)}
        try:
            for p in points:
                steps = RepeatedStep(p, setting.config.cache.block_size, ex.vocab_size, 0)
                times: dict[str, list[float]] = {k: [] for k in sides}
                for side in list(sides) * (args.pairs + 1):
                    for m in linears:
                        m._gemv, m.dense_above_rows = sides[side]
                    t0 = time.perf_counter()
                    ex.execute_dp([steps.next()])
                    times[side].append(time.perf_counter() - t0)
                ex.execute_dp([steps.retire()])
                timed = {k: v[1:] for k, v in times.items()}     # the first pair warms up
                med = {k: statistics.median(v) * 1e3 for k, v in timed.items()}
                key = f"batch {p.batch_size} context {p.context_len} new {p.new_tokens}"
                results[key] = {"median_ms": med, "a_over_b": med["A"] / med["B"],
                                "b_faster_in_pairs": sum(a > b for a, b in zip(timed["A"], timed["B"])),
                                "steps_ms": {k: [round(x * 1e3, 2) for x in v] for k, v in timed.items()}}
                print(f"{key}: A {med['A']:.2f} ms, B {med['B']:.2f} ms, A/B {med['A'] / med['B']:.3f} "
                      f"(B faster in {results[key]['b_faster_in_pairs']} of {args.pairs})", flush=True)
        finally:
            ex.shutdown()
    record = {"bench": "avx2 step A/B (ad hoc)", "ref": args.ref, "a_dense_above_rows": args.a_dense_above_rows,
              "b_dense_above_rows": Avx2Linear.dense_above_rows, "avx2_linears": len(linears),
              "threads": torch.get_num_threads(), "cpu": processor_name(), "load_before": load_before,
              "load_after": os.getloadavg(), "results": results}
    if args.output:
        with open(args.output, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
