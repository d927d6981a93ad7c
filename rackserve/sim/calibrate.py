"""The `cpu` device: this machine, calibrated by `bench forward`'s measured step times.

Peaks are the machine's limits measured by `bench forward` on the spot (matmul FLOP/s, memory
read bandwidth); the efficiency factors (dense GEMM, attention math, weight streaming, KV reads)
and the fixed step and per-sequence overheads are fitted so that the cost model's step times match the measured
median step times (least squares on log time, a coordinate search: six numbers, a few dozen
points). `python -m rackserve.sim.calibrate FORWARD.json... [--output FILE]` writes the device;
sim/calibration/cpu.json is the saved one that `--hardware cpu` loads.

It owns the fit; it must never run the model itself (bench forward does) nor import torch.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
from collections.abc import Sequence

from rackserve.sim.cost import PREFIX_CLASS, CostModel, SeqWork, packed_class
from rackserve.sim.hardware import Hardware
from rackserve.sim.model_spec import ModelSpec, load_model_spec

CPU_CALIBRATION = os.path.join(os.path.dirname(__file__), "calibration", "cpu.json")
FITTED = ("gemm_flops", "attn_flops", "mem_bw", "attn_mem_bw")
RECORD = ("measured", "held_out", "command", "key", "serve", "forward_commands", "engine_code")   # how a file was made
_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8"}
FIRST_STEPS = 3
TRACE_POINTS = 120          # steps of a trace in a fit: enough to cover its mix, few enough to fit in seconds


def load_calibration(path: str = CPU_CALIBRATION) -> tuple[Hardware, dict]:
    """A saved calibration: the device, and what the model ran as when it was measured ("spec":
    weight and KV precision, weight bytes per parameter, the packed kernel and its dense threshold;
    empty for an older file: fp32)."""
    if not os.path.isfile(path):
        raise ValueError(f"no cpu calibration at {path}: "
                         "run python -m rackserve.sim.calibrate on bench forward results")
    with open(path) as f:
        d = json.load(f)
    spec = d.pop("spec", {})
    for key in RECORD:
        d.pop(key, None)
    return Hardware(**d), spec


def load_cpu(path: str = CPU_CALIBRATION) -> Hardware:
    return load_calibration(path)[0]


def calibrated_spec(spec: ModelSpec, as_measured: dict) -> ModelSpec:
    """`spec` as the calibration's steps ran it (precision, packed weights)."""
    precision = as_measured.get("weight_precision", "fp32")
    spec = spec.with_precision(precision, as_measured.get("kv_precision", precision))
    return dataclasses.replace(spec, dense_weight_bytes=as_measured.get("weight_bytes_per_param"),
                               dequantize_above_tokens=as_measured.get("dequantize_above_tokens"),
                               packed_kernel=as_measured.get("quant_kernel"))


def _as_measured(spec: ModelSpec, result: dict) -> dict:
    """What a bench forward result's side A ran: its dtype, its weights' bytes per parameter (a
    GGUF's packed linears read fewer than the dtype's), and the kernels the engine chose as it
    recorded them (bench/engine_kernels.py): the packed kernel, the step size above which it
    dequantizes, and whether decode attention read each sequence's blocks in place."""
    setting = result["settings"]["A"]
    kernels = setting.get("kernels")
    if kernels is None:
        raise ValueError("a bench forward result without settings.A.kernels predates the recorded kernel "
                         "choice: re-run bench forward")
    precision = _DTYPES.get(setting["dtype"], "fp32")
    kv = _DTYPES.get(setting.get("kv_cache_dtype") or setting["dtype"], "fp32")   # recorded since the fifteenth round
    per_param = setting["cost"]["weight_bytes"] / (spec.dense_params_per_token + spec.lm_head_params)
    return {"weight_precision": precision, "kv_precision": kv, "weight_bytes_per_param": per_param,
            "quant_kernel": kernels["quant_kernel"], "dequantize_above_tokens": kernels["dense_above_rows"],
            "native_decode_attention": kernels["native_decode_attention"]}


def as_measured_kernels(as_measured: dict) -> dict:
    """The kernels of a calibration's record, as bench/engine_kernels.py names them."""
    return {"quant_kernel": as_measured.get("quant_kernel"),
            "dense_above_rows": as_measured.get("dequantize_above_tokens"),
            "native_decode_attention": as_measured.get("native_decode_attention")}


def trace_points(trace: dict, most: int = TRACE_POINTS) -> list[tuple[list[SeqWork], float]]:
    """(batch, measured seconds) of a step trace's steps (bench/step_trace.py: the steps a served
    workload's scheduler formed, mixed prefill chunks and decodes), at most `most` of them spread
    evenly over the steps' token counts (one DP rank)."""
    # A fresh executor's first steps carry one-time costs (allocations, kernel selection): skipped.
    steps = sorted((s for run in trace["runs"] for s in run["steps"][FIRST_STEPS:]
                    if len(s["batches"]) == 1 and s["batches"][0]), key=lambda s: sum(w[0] for w in s["batches"][0]))
    if len(steps) > most:
        steps = [steps[round(i * (len(steps) - 1) / (most - 1))] for i in range(most)]
    return [([SeqWork(*w) for w in s["batches"][0]], s["measured_s"]) for s in steps]


def forward_points(result: dict, side: str = "A") -> list[tuple[list[SeqWork], float]]:
    """(batch, measured median seconds) of each point of a `bench forward` JSON (one side)."""
    out = []
    for p in result["points"]:
        batch = [SeqWork(p["new_tokens"], p["context_len"], True)] * p["batch_size"]
        out.append((batch, p[side]["median_s"]))
    return out


def check(path: str, side: str, spec: ModelSpec, hw: Hardware) -> list[dict]:
    """The model's error on a bench forward result it was not fitted to."""
    with open(path) as f:
        points = forward_points(json.load(f), side)
    model = CostModel(spec, hw)
    return [{"file": os.path.basename(path), "side": side, "batch_size": len(b), "new_tokens": b[0].new_tokens,
             "context_len": b[0].context, "measured_s": t, "simulated_s": model.step([b]).seconds}
            for b, t in points]


def _cpu(flops: float, bw: float, eff: dict[str, float], overheads: tuple[float, float], source: str,
         pads_decodes: bool = True, decode_scale: float = 1.0, decode_attn_threads: int = 0,
         decode_attn_isa: str = "avx512") -> Hardware:
    return Hardware("cpu", {"fp32": flops, "bf16": flops}, bw, 64e9, bw, bw, 1, link_latency=50e-6,
                    step_overhead=overheads[0], seq_overhead=overheads[1], overlap=False, efficiency=dict(eff),
                    source=source, pads_decodes=pads_decodes, decode_scale=decode_scale,
                    decode_attn_threads=decode_attn_threads, decode_attn_isa=decode_attn_isa)


def _error(spec: ModelSpec, hw: Hardware, points: Sequence[tuple[list[SeqWork], float]]) -> float:
    model = CostModel(spec, hw)
    return sum(math.log(model.step([batch]).seconds / t) ** 2 for batch, t in points)


def fit(spec: ModelSpec, points: Sequence[tuple[list[SeqWork], float]], flops: float, bw: float,
        source: str = "", pads_decodes: bool = True, native_decode_step: bool = False,
        decode_attn_threads: int = 0, decode_attn_isa: str = "avx512") -> Hardware:
    """The cpu device whose cost model best matches the measured points (and, for packed weights,
    the packed kernel's own rate, from the points of up to its dense threshold's rows).
    `pads_decodes`: whether the measured engine's decode attention padded to the longest decode;
    `native_decode_step`: whether it ran steps of decodes in one native call (their own factor);
    `decode_attn_threads`: the threads its native decode attention split decodes over (0: none), in
    `decode_attn_isa`'s build of the native library."""
    # The packed kernel's rate is a share of the float32 matmul's peak but not bounded by it: integer
    # dot products outrun float32 FMAs (the vnni kernel ran 2.4-3.5x the float32 matmul on a Zen 5,
    # where a cap at 1 left a 512-token prefill modelled at 2.3x its measured time).
    packed = (packed_class(spec.packed_kernel),) if spec.dequantize_above_tokens is not None else ()
    # Prompt chunks after a cached context measured: their attention over it gets a rate of its own.
    prefix = (PREFIX_CLASS,) if any(w.new_tokens > 1 and w.context for batch, _ in points for w in batch) else ()
    classes = FITTED + packed + prefix
    params = {**{k: 0.5 for k in classes}, "step_overhead": 0.005, "seq_overhead": 0.001}
    if native_decode_step:
        params["decode_scale"] = 1.0

    def device(p: dict[str, float]) -> Hardware:
        return _cpu(flops, bw, {k: p[k] for k in classes}, (p["step_overhead"], p["seq_overhead"]), source,
                    pads_decodes, p.get("decode_scale", 1.0), decode_attn_threads, decode_attn_isa)

    best = _error(spec, device(params), points)
    step = 2.0
    while step > 1.01:
        improved = False
        for key in params:
            for factor in (step, 1 / step):
                trial_params = dict(params)
                trial_params[key] *= factor
                if key in classes and key not in packed:
                    trial_params[key] = min(1.0, trial_params[key])
                trial = _error(spec, device(trial_params), points)
                if trial < best - 1e-12:
                    best, params, improved = trial, trial_params, True
        if not improved:
            step = math.sqrt(step)
    return device(params)


def fit_forward_results(results: Sequence[dict], model: str, source: str,
                        traces: Sequence[dict] = ()) -> tuple[Hardware, dict, list[dict]]:
    """The cpu device fitted to bench forward results (one model, dtype and quantization) and the
    steps of step traces, what the model ran as, and each point's measured and modelled step time."""
    base = load_model_spec(model)
    as_measured = _as_measured(base, results[0])
    spec = calibrated_spec(base, as_measured)
    points = [pt for r in results for pt in forward_points(r)] + [pt for t in traces for pt in trace_points(t)]
    flops = statistics.median(r["limits"]["A"]["matmul_gflops"] for r in results) * 1e9
    bw = statistics.median(r["limits"]["A"]["mem_read_gbps"] for r in results) * 1e9
    for t in traces:
        if t.get("step_trace", {}).get("kernels", as_measured_kernels(as_measured)) != as_measured_kernels(as_measured):
            raise ValueError(f"a step trace ran other kernels ({t['step_trace']['kernels']}) than the bench forward "
                             f"results ({as_measured_kernels(as_measured)})")
    native_step = any((r["settings"]["A"].get("engine_code") or {}).get("native_decode_step") for r in results)
    as_measured["native_decode_step"] = native_step
    # The native decode attention's threads: those bench forward ran with (its limits' threads).
    threads = statistics.median(r["limits"]["A"].get("threads", 1) for r in results)
    # ...and the build they ran ("avx2-<digest>" in engine_code; avx512 where it predates the record).
    library = next(((r["settings"]["A"].get("engine_code") or {}).get("native_library") for r in results), None)
    hw = fit(spec, points, flops, bw, source, pads_decodes=not as_measured["native_decode_attention"],
             native_decode_step=native_step,
             decode_attn_threads=int(threads) if as_measured["native_decode_attention"] else 0,
             decode_attn_isa=(library or "avx512").split("-")[0])
    model_ = CostModel(spec, hw)
    measured = [{"batch_size": len(b), "new_tokens": sum(w.new_tokens for w in b) // len(b),
                 "context_len": max(w.context for w in b), "measured_s": t, "simulated_s": model_.step([b]).seconds}
                for b, t in points]
    return hw, as_measured, measured


def save(path: str, hw: Hardware, as_measured: dict, measured: list[dict], held_out: list[dict],
         command: list[str], key: dict | None = None, serve: dict | None = None,
         engine_code: dict | None = None) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    record = {**hw.to_json(), "spec": as_measured, "key": key, "engine_code": engine_code, "measured": measured,
              "held_out": held_out, "serve": serve, "command": command}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)     # a run looking for calibrations never reads half a file


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="fit the cpu device to bench forward results")
    parser.add_argument("results", nargs="+", help="bench forward JSON files (same model, threads and dtype)")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the config the forward runs used")
    parser.add_argument("--output", default=CPU_CALIBRATION)
    parser.add_argument("--check", action="append", default=[], metavar="FILE[:SIDE][:KV_DTYPE]",
                        help="held out: print the fitted model's error on this bench forward result "
                        "(side A by default; KV_DTYPE e.g. bf16 when that side ran a 16-bit KV cache)")
    parser.add_argument("--steps", action="append", default=[], metavar="TRACE.json",
                        help="also fit to the steps of this step trace (python -m rackserve.bench.step_trace): "
                        "the mixed steps a served workload's scheduler forms")
    parser.add_argument("--serve", default=None, metavar="BENCH_SERVE.json",
                        help="also measure the serving path's cost from this bench serve run (serve_path.py)")
    parser.add_argument("--front-path", default=None, metavar="FRONT_PATH.json",
                        help="the server's front path a request (python -m rackserve.bench.front_path): priced "
                        "per request, and taken out of the --serve run's TTFT")
    parser.add_argument("--key", action="store_true",
                        help="key the calibration to this machine and the model's serve defaults, so "
                        "rackserve sim --hardware cpu finds it")
    args = parser.parse_args(argv)
    results = [json.load(open(path)) for path in args.results]
    traces = [json.load(open(path)) for path in args.steps]
    hw, as_measured, measured = fit_forward_results(
        results, args.model, "fitted to " + ", ".join(os.path.basename(p) for p in args.results + args.steps), traces)
    spec = calibrated_spec(load_model_spec(args.model), as_measured)
    for m in measured:
        print(f"batch {m['batch_size']:3d} x {m['new_tokens']:4d} new after {m['context_len']:5d}: measured "
              f"{m['measured_s'] * 1e3:7.1f} ms, model {m['simulated_s'] * 1e3:7.1f} ms "
              f"({m['simulated_s'] / m['measured_s'] - 1:+.0%})")
    print("efficiency", {k: round(v, 3) for k, v in hw.efficiency.items()}, f"overhead {hw.step_overhead * 1e3:.1f} ms "
          f"a step + {hw.seq_overhead * 1e3:.2f} ms a sequence")
    held_out = []
    for item in args.check:
        path, side, kv = (item.split(":") + [""] * 2)[:3]
        side = side or "A"
        held_out += check(path, side, spec.with_precision(kv=kv or None), hw)
    for m in held_out:
        print(f"held out {m['file']} {m['side']}: batch {m['batch_size']} after {m['context_len']}: measured "
              f"{m['measured_s'] * 1e3:.1f} ms, model {m['simulated_s'] * 1e3:.1f} ms "
              f"({m['simulated_s'] / m['measured_s'] - 1:+.0%})")
    serve = None
    if args.front_path or args.serve:
        from rackserve.sim.serve_path import with_serving_terms
        hw, serve = with_serving_terms(hw, spec, args.serve, args.front_path)
    key = code = None
    if args.key:
        from rackserve.bench.engine_code import merged
        from rackserve.sim.cpu_device import serve_key
        setting = results[0]["settings"]["A"] if results else {}
        key = serve_key(args.model, None, setting.get("kv_cache_dtype"), setting.get("packed_activations"))
        # Keyed only to the code that measured it, still the code here (else refused: re-measure).
        code = merged([r["settings"]["A"].get("engine_code") for r in results]
                      + [t["step_trace"].get("engine_code") for t in traces])
    save(args.output, hw, as_measured, measured, held_out,
         ["python", "-m", "rackserve.sim.calibrate", *(argv if argv is not None else sys.argv[1:])], key, serve, code)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
