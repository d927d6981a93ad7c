"""`rackserve bench forward`: times exact prefill or decode batches through the real execute path
(`Executor.execute_dp`, any executor, each DP rank its share) with the context already in the
KV cache, and prints median step time, spread, tokens/s and the share of the machine's limits
(measured on the spot) that the step reaches; `--compare KEY=VALUE[,KEY=VALUE...]` times
another setting in the same process, alternating with the first, and prints the ratio B/A
(repeated: sides C, D, ... alternate too); `--profile` splits the step by layer kind.

This file owns the command: flags, the A/B settings, the table and the JSON. The steps, their
cost and the timing loop live in forward_steps.py. It must never import torch at module level
(`rackserve --help` imports it) and never asserts a speed.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import sys
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from rackserve.bench.engine_code import engine_code, runner_native_decode
from rackserve.bench.engine_kernels import engine_kernels
from rackserve.bench.forward_steps import ForwardPoint, ModelCost, Side, Timing, model_cost, time_point
from rackserve.config import EngineArgs, EngineConfig
from rackserve.executor.base import Executor, create_executor
from rackserve.serve.cli import register_subcommand

if TYPE_CHECKING:
    from rackserve.bench.limits import Limits


@dataclass
class Setting:
    """One side of an A/B: an executor, its config, and what its steps cost at least."""
    label: str                  # "A", then "B", "C", ... for each --compare
    executor_name: str
    config: EngineConfig
    executor: Executor
    cost: ModelCost


def build_setting(label: str, engine_args: EngineArgs, executor_name: str | None,
                  points: list[ForwardPoint]) -> Setting:
    config = engine_args.create_engine_config()
    if config.cache.num_gpu_blocks_override is None:
        # Sized to the largest batch: the bench uses no more, and zeroing a larger cache takes time.
        need = max(p.num_blocks(config.cache.block_size) for p in points)
        config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, num_gpu_blocks_override=need))
    executor = create_executor(config, executor_name)
    try:
        config = config.with_model_len(executor.model_max_len)
        for p in points:
            if p.kv_len > config.model.max_model_len:
                raise ValueError(f"context {p.context_len} + {p.new_tokens} new tokens exceed max_model_len "
                                 f"{config.model.max_model_len}")
            blocks = p.num_blocks(config.cache.block_size)
            if blocks > executor.num_kv_blocks:
                raise ValueError(f"batch {p.batch_size} x {p.kv_len} tokens needs {blocks} KV blocks, the cache has "
                                 f"{executor.num_kv_blocks} (--num-gpu-blocks-override)")
        return Setting(label, executor_name or type(executor).__name__, config, executor,
                       model_cost(config.model, config.cache.cache_dtype))
    except BaseException:
        executor.shutdown()
        raise


def parse_compare(compare: str, engine_args: EngineArgs,
                  executor_name: str | None) -> tuple[EngineArgs, str | None]:
    """`KEY=VALUE[,KEY=VALUE...]` with each KEY an engine option (as its flag or field name) or
    `executor`: one compared side, A's settings with these changed (a DEP side changes two:
    data_parallel_size=2,enable_expert_parallel=true)."""
    types = {f.name: str(f.type) for f in fields(EngineArgs)}
    for item in compare.split(","):
        key, sep, value = item.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep or not key:
            raise ValueError(f"--compare takes KEY=VALUE[,KEY=VALUE...] (e.g. dtype=bfloat16), got {compare!r}")
        if key == "executor":
            executor_name = value
            continue
        if key not in types:
            raise ValueError(f"--compare: unknown option {key!r}; one of {sorted(types) + ['executor']}")
        kind = types[key]
        if value.lower() == "none" and "None" in kind:
            parsed: object = None
        elif "bool" in kind:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"--compare: {key} takes true or false, got {value!r}")
            parsed = value.lower() in ("true", "1")
        else:
            parsed = int(value) if "int" in kind else float(value) if "float" in kind else value
        engine_args = dataclasses.replace(engine_args, **{key: parsed})
    return engine_args, executor_name


# ---- the command --------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values:
        raise ValueError(f"expected a comma-separated list of integers, got {text!r}")
    return values


def _add_forward_args(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--executor", default=None,
                        help="executor by registry name (default: the engine's choice for --tensor-parallel-size)")
    parser.add_argument("--mode", choices=["decode", "prefill"], default="decode",
                        help="decode: each request computes 1 token after its context; prefill: --new-tokens")
    parser.add_argument("--batch-sizes", default="1,8,32", help="requests per step, comma-separated")
    parser.add_argument("--context-lens", default="0,512,2048", help="tokens already in the KV cache per request")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per request per step (prefill mode)")
    parser.add_argument("--seconds", type=float, default=3.0, help="timed seconds per point and setting")
    parser.add_argument("--warmup-steps", type=int, default=3, help="untimed steps per point and setting")
    parser.add_argument("--compare", metavar="KEY=VALUE[,KEY=VALUE]", action="append",
                        help="A/B: also time these engine options (or executor=NAME) changed, alternating with A; "
                             "repeat for sides C, D, ...")
    parser.add_argument("--profile", action="store_true",
                        help="share of step time per layer kind (in-process executor only)")
    parser.add_argument("--output", help="write the results as JSON here")


def _limit_shares(cost: ModelCost, limits: Limits, point: ForwardPoint, median_s: float) -> dict[str, float]:
    """Bytes and FLOPs the step must at least move and do, per second, against the machine's."""
    gbps = cost.step_bytes(point) / median_s / 1e9
    gflops = cost.step_flops(point) / median_s / 1e9
    return {"gb_s": gbps, "bandwidth_share": gbps / limits.mem_read_gbps,
            "gflop_s": gflops, "matmul_share": gflops / limits.matmul_gflops}


HEADER = (f"{'':>2} {'batch':>5} {'ctx':>6} {'steps':>6} {'median ms':>9} {'p10-p90 ms':^17} {'tok/s':>9} "
          f"{'GB/s':>7} {'%bw':>5} {'GFLOP/s':>8} {'%mm':>5}")


def _row(label: str, point: ForwardPoint, t: Timing, shares: dict[str, float]) -> str:
    s = t.summary()
    return (f"{label:>2} {point.batch_size:>5} {point.context_len:>6} {s['steps']:>6} {s['median_s'] * 1e3:>9.2f} "
            f"{s['p10_s'] * 1e3:>8.2f}-{s['p90_s'] * 1e3:<8.2f} {s['tok_s']:>9.1f} {shares['gb_s']:>7.1f} "
            f"{shares['bandwidth_share']:>5.0%} {shares['gflop_s']:>8.1f} {shares['matmul_share']:>5.0%}")


def _plan(args: argparse.Namespace) -> tuple[list[ForwardPoint], list[tuple[str, EngineArgs, str | None]]]:
    """The points and the sides (label, engine args, executor name), validated before any loading."""
    new = 1 if args.mode == "decode" else args.new_tokens
    if new < 1 or args.seconds < 0 or args.warmup_steps < 0:
        raise ValueError("--new-tokens must be >= 1, --seconds and --warmup-steps >= 0")
    points = [ForwardPoint(args.mode, b, c, new) for b in _ints(args.batch_sizes) for c in _ints(args.context_lens)]
    if any(p.batch_size < 1 or p.context_len < 0 for p in points):
        raise ValueError("batch sizes must be >= 1 and context lengths >= 0")
    base = EngineArgs.from_cli_args(args)
    compares = args.compare or []
    if len(compares) > 25:
        raise ValueError("--compare: at most 25 sides besides A")
    sides = [("A", base, args.executor)]
    sides += [(chr(ord("B") + i), *parse_compare(c, base, args.executor)) for i, c in enumerate(compares)]
    for _, engine_args, _ in sides:
        engine_args.create_engine_config()     # bad option values fail here, before a model loads
    return points, sides


@functools.lru_cache(maxsize=None)
def _limits(device: str, dtype: str) -> Limits:
    """The machine's limits for (device, dtype), measured once per process: several runs of the
    command in one process (the simulator's calibration runs three) share them."""
    import torch

    from rackserve.bench.limits import measure_limits
    return measure_limits(device, getattr(torch, dtype))


def _measure_limits(sides: list[tuple[str, EngineArgs, str | None]]) -> dict[str, Limits]:
    """Per side, measured once per (device, dtype): an A/B of dtypes gets each dtype's matmul rate."""
    limits = {}
    for label, engine_args, _ in sides:
        model = engine_args.create_engine_config().model
        limits[label] = _limits(model.device, model.dtype)
        print(f"machine ({label}: {model.dtype}): {limits[label].describe()}")
    return limits


def _time_points(settings: list[Setting], points: list[ForwardPoint], limits: dict[str, Limits],
                 args: argparse.Namespace) -> list[dict]:
    print(HEADER)
    results = []
    sides = [Side(s.executor, s.config) for s in settings]
    for point in points:
        timings = time_point(sides, point, args.seconds, args.warmup_steps, args.seed, args.profile)
        entry: dict = {"batch_size": point.batch_size, "context_len": point.context_len, "new_tokens": point.new_tokens}
        for s, t in zip(settings, timings):
            shares = _limit_shares(s.cost, limits[s.label], point, t.median_s)
            entry[s.label] = {**t.summary(), **shares, "step_bytes": s.cost.step_bytes(point),
                              "step_flops": s.cost.step_flops(point)}
            print(_row(s.label, point, t, shares))
            if args.profile:
                print("      profile: " + (", ".join(f"{k} {v:.0%}" for k, v in t.profile.items()) if t.profile
                                         else f"not available (executor {s.executor_name!r} runs the model outside "
                                              "this process)"))
                if t.native_profile:
                    print("      native decode step: " + ", ".join(f"{k} {v:.0%}" for k, v in t.native_profile.items()))
        for s, t in zip(settings[1:], timings[1:]):
            ratio = entry[f"{s.label.lower()}_over_a"] = {"tok_s": t.tok_s / timings[0].tok_s,
                                                          "median_step": t.median_s / timings[0].median_s}
            print(f"   {s.label}/A: tok/s {ratio['tok_s']:.2f}x, step time {ratio['median_step']:.2f}x")
        results.append(entry)
    return results


def _kv_groups(executor: Executor) -> list[dict] | None:
    """Per KV cache group of a model with several: bytes per token (all layers; the sliding group's
    for the tokens it keeps), tokens per block, blocks."""
    kv_config = executor.kv_cache_config
    return None if kv_config is None else [dataclasses.asdict(g) for g in kv_config.groups]


@register_subcommand("bench forward", "time exact prefill or decode batches through the real execute path, "
                     "against the machine's limits; --compare KEY=VALUE for an A/B", _add_forward_args)
def run_forward(args: argparse.Namespace) -> int:
    settings: list[Setting] = []
    try:
        try:
            points, sides = _plan(args)
            limits = _measure_limits(sides)
            for label, engine_args, executor_name in sides:
                settings.append(build_setting(label, engine_args, executor_name, points))
        except (ValueError, FileNotFoundError) as e:
            print(f"rackserve bench forward: {e}", file=sys.stderr)
            return 2
        print(f"{args.mode}: {points[0].new_tokens} new token(s) per request per step, {args.seconds:g} s per point"
              + "".join(f"; {s.label} = {c}" for s, c in zip(settings[1:], args.compare or [])))
        for s in settings:
            if s.executor.kv_cache_config is not None:
                from rackserve.executor.kv_groups import describe
                print(f"{s.label}: KV cache groups: {describe(s.executor.kv_cache_config)}")
        # Other work on the machine shows in the spread; the load says whether there was any.
        load = [os.getloadavg()[0]]
        results = _time_points(settings, points, limits, args)
        load.append(os.getloadavg()[0])
        print(f"1-minute load average {load[0]:.1f} before, {load[1]:.1f} after, on {os.cpu_count()} CPUs")
        # The code that computed these steps (the simulator reuses a calibration only while it is unchanged).
        code = {s.label: engine_code(s.config.model.native_isa, runner_native_decode(s.executor)) for s in settings}
    finally:
        for s in settings:
            s.executor.shutdown()
    result = {"bench": "forward", "model": args.model, "mode": args.mode, "new_tokens": points[0].new_tokens,
              "seconds": args.seconds, "warmup_steps": args.warmup_steps, "compare": args.compare,
              "settings": {s.label: {"executor": s.executor_name, "dtype": s.config.model.dtype,
                                     "device": s.config.model.device, "block_size": s.config.cache.block_size,
                                     "kv_cache_dtype": s.config.cache.cache_dtype or s.config.model.dtype,
                                     "packed_activations": s.config.model.packed_activations,
                                     "num_kv_blocks": s.executor.num_kv_blocks, "cost": dataclasses.asdict(s.cost),
                                     "kv_cache_groups": _kv_groups(s.executor),
                                     "kernels": engine_kernels(s.config.model, s.config.cache.cache_dtype),
                                     "engine_code": code[s.label]}
                           for s in settings},
              "limits": {label: vars(lim) for label, lim in limits.items()}, "load_average": load, "points": results,
              "command": "rackserve " + " ".join(sys.argv[1:]), "machine": platform.processor() or platform.machine()}
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.output}")
    return 0
