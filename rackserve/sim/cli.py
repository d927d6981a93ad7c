"""`rackserve sim`: `bench serve` on paper. The same workloads, closed-loop lanes, think times,
warm-ups, validity rules, metrics and JSON (so `bench plot` draws simulated and measured curves
together), played in virtual time against simulated instances: the real EngineCore, Scheduler and
KV cache manager over a SimExecutor whose steps a hardware cost model prices.

This file owns the command's flags and the result's "sim" section; it must never compute a metric
(bench/metrics.py does) nor price a step (cost.py does).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from rackserve.serve.cli import register_subcommand


def add_args(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--model", default="smollm2-135m-instruct", help="a config.json, an HF directory, or an alias of sim/configs")
    a("--hardware", default="cpu", help="H100, H200, B200, GB200, GB300, MI355X, VR200, cpu (this machine's "
      "calibration) or a JSON file")
    a("--quantization", default=None, help="weight precision override: bf16, fp8, fp4 (on cpu: gguf or none, "
      "as rackserve serve takes it; default: serve's)")
    a("--calibration-dir", default=None, help="cpu: where run-time calibrations are saved and looked up first "
      "(default ~/.cache/rackserve/sim)")
    a("--kv-cache-dtype", default=None, help="KV cache precision override: bf16, fp8, fp4 (fp32, fp16, bf16 or fp8 for "
      "cpu: a calibration measured with that cache)")
    a("--packed-activations", default=None, choices=["two-part", "adaptive", "one-part"],
      help="cpu: a calibration measured with serve's --packed-activations (vnni kernel only; default: serve's)")
    a("--tensor-parallel-size", type=int, default=1, help="devices splitting each layer (per DP rank)")
    a("--data-parallel-size", type=int, default=1, help="DP ranks per instance, stepping in lockstep")
    a("--enable-expert-parallel", action="store_true", help="experts over all the instance's devices (all-to-all)")
    a("--expert-skew", type=float, default=0.0, help="Zipf exponent of expert popularity (0: uniform gate)")
    a("--num-speculative-tokens", type=int, default=0, help="MTP draft tokens per step")
    a("--acceptance-rate", type=float, default=0.0, help="chance that each draft token is accepted")
    a("--instances", type=int, default=1, help="engine instances behind the router")
    a("--router-policy", default="least_load", help="the cluster router's kv, kv_prefill, prefix, least_load or round_robin "
      "(fed the instances' KV events; it picks the DP rank too), or least_uncached (reads the prefix caches)")
    a("--kv-pool-memory", type=float, default=0.0, help="GiB of a KV pool all instances share (0: none); "
      "prompt blocks it holds beyond an instance's own hit load at --kv-pool-bandwidth instead of computing")
    a("--kv-pool-bandwidth", type=float, default=None, help="GB/s an instance loads pool blocks at "
      "(default: the device's scale-out link)")
    a("--dp-placement", default="router", help="DP rank of a new request: router (the router's policy pins it, "
      "as rackserve router pins data_parallel_rank; with least_uncached routing the engine's least_load), "
      "least_load (the engine's: fewest requests) or least_uncached (least uncached prompt work, prefix hits "
      "counted); the router then picks the instance only")
    a("--prefill", type=int, default=0, help="P/D: prefill instances (with --decode: decode instances)")
    a("--decode", type=int, default=0, help="P/D: decode instances, of the main parallel shape")
    a("--prefill-tensor-parallel-size", type=int, default=None, help="P/D: the prefill instances' TP")
    a("--prefill-data-parallel-size", type=int, default=None, help="P/D: the prefill instances' DP")
    a("--prefill-max-num-batched-tokens", type=int, default=None, help="P/D: the prefill instances' budget")
    a("--max-num-seqs", type=int, default=64, help="most requests running per DP rank")
    a("--max-num-batched-tokens", type=int, default=512, help="token budget of a step per DP rank")
    a("--long-prefill-token-threshold", type=int, default=0, help="most prompt tokens one request computes in a "
      "step (vLLM's flag; 0: no cap): a step's budget then spans several prompts")
    a("--max-waiting-tokens", type=int, default=0, help="steps in a row prompt work may wait while requests "
      "decode (TGI's flag, as rackserve serve takes it; 0: never)")
    a("--max-model-len", type=int, default=None, help="longest prompt + output (default: the model's)")
    a("--kv-cache-memory", type=float, default=2.0, help="GiB of KV cache per device")
    a("--num-gpu-blocks-override", type=int, default=None, help="exact KV blocks per DP rank")
    a("--block-size", type=int, default=16, help="tokens per KV block (256 keeps full-size runs light)")
    a("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false", help="no prefix cache")
    a("--workload", default="agentx", help="agentx, random, or trace:FILE")
    a("--concurrency", default="1,2,4,8", help="comma-separated lane counts, one run each")
    a("--duration", type=float, default=60.0, help="virtual seconds during which requests start, per run")
    a("--seed", type=int, default=0, help="seeds the workload, the random starts and the expert draws")
    a("--scale", type=float, default=None, help="agentx: multiplies every token count (default 0.005)")
    a("--output-scale", type=float, default=None, help="agentx: multiplies output lengths instead")
    a("--think-time-cap", type=float, default=5.0, help="longest think time honoured, seconds")
    a("--prefill-only", action="store_true", help="every request asks for one output token (prefill-only runs)")
    a("--random-input-len", type=int, default=1024, help="random: prompt tokens")
    a("--random-output-len", type=int, default=128, help="random: output tokens")
    a("--tokenizer", default=None, help="whose chat template wraps each prompt's words (its role markers, default "
      "system prompt and generation prompt, measured once): a .gguf, HF directory or alias; default: the model's "
      "own where it has one (a served model), none for config-only aliases; 'none': words only")
    a("--label", default=None, help="name of this run in plots")
    a("--output", default=None, help="write the runs as `bench serve` does")
    a("--summary-only", action="store_true", help="--output without every request's record (small files)")
    a("--plot", default=None, help="draw throughput per device against P90 interactivity")


@register_subcommand("sim", "simulate bench serve on a hardware cost model, in virtual time", add_args)
def run(args: argparse.Namespace) -> int:
    from rackserve.bench.serve_bench import summary_table, write_result
    from rich.console import Console
    console = Console()
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
        if min(levels) < 1 or args.duration <= 0 or args.instances < 1:
            raise ValueError("concurrency levels, duration and instances must be positive")
        result = simulate(args, levels)
    except (ValueError, FileNotFoundError) as e:
        print(f"rackserve sim: {e}", file=sys.stderr)
        return 2
    for run_ in result["runs"]:
        console.print(summary_table(_summary(run_["summary"])))
        sim = run_["sim"]
        console.print(f"  simulated {sim['virtual_seconds']:.1f} s in {sim['wall_seconds']:.1f} s of wall time "
                      f"({sim['speedup']:.0f}x); {sim['steps']} steps, DP idle {sim['dp_idle_share']:.1%} "
                      f"({sim['dp_idle_share_steady']:.1%} while requests start)")
    if args.output and args.summary_only:
        for run_ in result["runs"]:
            run_.pop("requests")
    return write_result(result, args.output, args.plot)


def _summary(d: dict):
    from rackserve.bench.metrics import Percentiles, RunSummary
    d = dict(d)
    for k in ("ttft", "itl", "e2el"):
        d[k] = Percentiles(**d[k])
    return RunSummary(**d)


class PrefillOnly:
    """A workload whose every turn asks for one output token, as AgentX's prefill-only runs do."""

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name + "+prefill-only"
        self.scale, self.output_scale = inner.scale, inner.output_scale

    def __len__(self) -> int:
        return len(self.inner)

    def session(self, index: int):
        return _one_token(self.inner.session(index))

    def describe(self, max_sessions: int = 500):
        from rackserve.bench.workload import workload_stats
        return workload_stats([self.session(i) for i in range(min(len(self), max_sessions))])


def _one_token(session):
    from rackserve.bench.workload import SubagentGroup
    steps = tuple(SubagentGroup(tuple(_one_token(a) for a in s.agents)) if isinstance(s, SubagentGroup)
                  else dataclasses.replace(s, output_len=1) for s in session.steps)
    return dataclasses.replace(session, steps=steps)


def _stats_sessions(workload) -> int:
    """Sessions behind the workload statistics: bench serve's 500, fewer for full-size sessions
    (their exact hit-rate accounting costs minutes, not the simulation's seconds)."""
    return 500 if (workload.scale or 0.0) < 0.05 else 50


def simulate(args: argparse.Namespace, levels: list[int], executor_factory=None) -> dict:
    """Every level; the JSON-ready result, laid out as `bench serve`'s. `executor_factory`: builds
    the instances' executors instead (SimSetup.executor_factory; a step trace's timed real one)."""
    from rackserve.bench.token_text import default_vocabulary
    from rackserve.bench.workload import WorkloadOptions, make_workload
    from rackserve.sim.cpu_device import load_device
    from rackserve.sim.instance import SimSetup
    from rackserve.sim.model_spec import load_model_spec
    from rackserve.sim.prompt_ids import BlockRenderer
    load_model_spec(args.model)   # an unknown model fails before any calibration
    hardware, as_measured, calibration = load_device(args.hardware, args.model, args.quantization,
                                                     args.calibration_dir, args.kv_cache_dtype,
                                                     args.packed_activations)
    setup = dataclasses.replace(SimSetup.from_args(args, hardware, as_measured), executor_factory=executor_factory)
    workload = make_workload(args.workload, WorkloadOptions(
        seed=args.seed, scale=args.scale, output_scale=args.output_scale, max_context=setup.max_model_len,
        random_input_len=args.random_input_len, random_output_len=args.random_output_len))
    if args.prefill_only:
        workload = PrefillOnly(workload)
    renderer = BlockRenderer(default_vocabulary(), args.seed)   # blocks, not text: the same ids, faster
    devices = setup.all_devices
    result = {"label": args.label or f"sim {args.model} on {args.hardware}", "base_url": None, "model": args.model,
              "workload": args.workload, "scale": workload.scale, "output_scale": workload.output_scale,
              "seed": args.seed, "devices": devices, "duration": args.duration, "think_time_cap": args.think_time_cap,
              "max_context": setup.max_model_len, "eos": "ignore_eos", "vocabulary": "one word per token",
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": sys.argv,
              "workload_stats": dataclasses.asdict(workload.describe(_stats_sessions(workload))),
              "sim": {**setup.describe(), "calibration": calibration}, "runs": []}
    for concurrency in levels:
        result["runs"].append(setup.run_level(workload, renderer, concurrency, args.duration, args.think_time_cap,
                                              args.seed))
    return result
