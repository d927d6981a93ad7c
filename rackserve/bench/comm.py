"""`rackserve bench comm`: latency of the collectives tensor and expert parallelism pay per layer,
between worker processes of this machine, through the very calls the model layers make
(GroupCoordinator.all_reduce, all_gather, all_to_all, broadcast_object), for small and large
messages; with `--model`, also real tensor-parallel (or, with --enable-expert-parallel, expert-
parallel; with --data-parallel-size, DEP) steps of that model, and how much of each step every
rank spends inside collectives (waiting for its peers included); with `--profile`, every rank's
step split by layer kind, its communication apart.

For the collectives rank 0's view is reported: per message size the median, mean and p90 of one
call, and the bandwidth (bytes / median). all_gather's bytes are each rank's share; all_to_all's
are what each rank sends, in equal parts to every rank (itself included), as a MoE dispatch does.
A forward pass waits out every call in turn, so what it pays is the mean (tails included) times
its calls per step; docs/parallelism.md works this out.
This file owns the command; it must never import torch at module level, and never asserts a speed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from multiprocessing.connection import Connection

from rackserve.bench.forward_steps import PROFILE_STEPS
from rackserve.serve.cli import register_subcommand

OPS = ("all_reduce", "all_gather", "all_to_all", "broadcast_object")
WARMUP = 20             # untimed calls per op and size
WARMUP_STEPS = 3        # untimed model steps per batch size


def _sizes(text: str) -> list[int]:
    """'256,4K,1M' -> bytes."""
    units = {"K": 2**10, "M": 2**20}
    out = [int(float(p.strip().upper().rstrip("KM")) * units.get(p.strip().upper()[-1:], 1))
           for p in text.split(",") if p.strip()]
    if not out or min(out) < 4:
        raise ValueError(f"--sizes takes byte counts >= 4 such as 256,4K,1M; got {text!r}")
    return out


def _add_comm_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=2, help="processes (ranks) on this machine")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo", help="torch.distributed backend")
    parser.add_argument("--sizes", default="256,2K,16K,128K,1M,8M",
                        help="message sizes in bytes (float32 tensors), comma-separated; K and M suffixes")
    parser.add_argument("--ops", default=",".join(OPS), help=f"collectives to time, from {', '.join(OPS)}")
    parser.add_argument("--iters", type=int, default=200, help=f"timed calls per op and size (after {WARMUP} more)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per rank (default: the machine's cores / world size, as workers use)")
    steps = parser.add_argument_group("model steps (with --model)")
    steps.add_argument("--model", default=None, help="also time tensor-parallel steps of this model (path or alias)")
    steps.add_argument("--mode", choices=["decode", "prefill"], default="decode")
    steps.add_argument("--batch-sizes", default="1,8", help="requests per step, comma-separated")
    steps.add_argument("--context-len", type=int, default=256, help="tokens already in the KV cache per request")
    steps.add_argument("--new-tokens", type=int, default=256, help="tokens per request per step (prefill mode)")
    steps.add_argument("--steps", type=int, default=30, help=f"timed steps per batch size (after {WARMUP_STEPS} more)")
    steps.add_argument("--enable-expert-parallel", action="store_true",
                       help="MoE models: shard the experts over the ranks instead of splitting each over them")
    steps.add_argument("--data-parallel-size", type=int, default=1,
                       help="DP ranks (TP = world size / DP); each runs its share of every batch")
    steps.add_argument("--profile", action="store_true",
                       help=f"{PROFILE_STEPS} more steps per batch size with each rank's time split by layer "
                            "kind, collectives apart")
    parser.add_argument("--output", help="write the results as JSON here")


def _rank_main(rank: int, spec: dict, port: int, conn: Connection) -> None:
    """One rank: time every (op, size), then the model's steps; send the rows to the parent."""
    import torch

    from rackserve.config import ParallelConfig
    from rackserve.distributed.parallel_state import CollectiveTimer, init_distributed
    device = "cuda" if spec["backend"] == "nccl" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    torch.set_num_threads(spec["threads"])
    timer = CollectiveTimer()
    parallel = ParallelConfig(spec["world_size"] // spec["data_parallel_size"], spec["backend"], master_port=port,
                              data_parallel_size=spec["data_parallel_size"],
                              enable_expert_parallel=spec["enable_expert_parallel"])
    groups = init_distributed(parallel, rank, timer)
    rows = [_time_collective(groups.world, op, size, spec["iters"], device)
            for op in spec["ops"] for size in spec["sizes"]]
    if spec["model"] is not None:
        rows += _time_model_steps(spec, groups, timer, rank)
    conn.send(rows)
    conn.close()
    # As the workers do: gloo aborts a process whose peer leaves while it tears its group down.
    os._exit(0)


def _time_collective(group, op: str, size: int, iters: int, device: str) -> dict:
    import torch
    x = torch.ones(size // 4, device=device)
    # all_to_all: equal parts for every rank; rows of one float each.
    part = size // 4 // group.world_size
    parts = [part] * group.world_size
    payload = {"token_ids": list(range(size // 8))}   # about `size` bytes pickled

    def call() -> None:
        if op == "all_reduce":
            group.all_reduce(x)
        elif op == "all_gather":
            group.all_gather(x)
        elif op == "all_to_all":
            group.all_to_all(x[:part * group.world_size], parts, parts)
        else:
            group.broadcast_object(payload if group.is_first_rank else None)
        if device == "cuda":
            torch.cuda.synchronize()
    for _ in range(WARMUP):
        call()
    group.broadcast_object(None)   # start the timed calls together
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    times.sort()
    median = statistics.median(times)
    return {"op": op, "bytes": size, "median_us": median * 1e6, "mean_us": statistics.mean(times) * 1e6,
            "p90_us": times[int(0.9 * (len(times) - 1))] * 1e6, "gb_s": size / median / 1e9}


def _time_model_steps(spec: dict, groups, timer, rank: int) -> list[dict]:
    """Steps as the workers run them: rank 0 broadcasts one SchedulerOutput per DP rank, every
    rank executes its DP rank's (its share of the batch, which is the total over DP ranks). Per
    batch size: median step time and median time inside collectives, on this rank; with
    `profile`, the shares of PROFILE_STEPS more steps by layer kind."""
    import dataclasses
    import functools

    from rackserve.bench.forward_steps import ForwardPoint, LayerKindProfiler, RepeatedStep, group_block_sizes
    from rackserve.config import EngineArgs
    from rackserve.executor.model_runner import ModelRunner
    new = 1 if spec["mode"] == "decode" else spec["new_tokens"]
    points = [ForwardPoint(spec["mode"], b, spec["context_len"], new) for b in spec["batch_sizes"]]
    dp = spec["data_parallel_size"]
    config = EngineArgs(model=spec["model"], tensor_parallel_size=spec["world_size"] // dp, data_parallel_size=dp,
                        distributed_backend=spec["backend"],
                        enable_expert_parallel=spec["enable_expert_parallel"]).create_engine_config()
    blocks = max(p.num_blocks(config.cache.block_size) for p in points)
    config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, num_gpu_blocks_override=blocks))
    runner = ModelRunner(config, groups=groups)
    world, dp_rank = groups.world, config.parallel.dp_rank_of(rank)

    def execute(steps: list[RepeatedStep], next_step) -> None:
        """One step: rank 0 takes each DP rank's next (or retiring) SchedulerOutput and sends them all."""
        step = world.broadcast_object([next_step(rs) for rs in steps] if rank == 0 else None)
        runner.execute_model(step[dp_rank])
    rows = []
    for point in points:
        steps = [RepeatedStep(point, config.cache.block_size, runner.model_info.vocab_size, 0, (r, dp),
                              group_block_sizes(runner.kv_cache_config)) for r in range(dp)]
        wall, inside = [], []
        for i in range(WARMUP_STEPS + spec["steps"]):
            timer.seconds, timer.calls = 0.0, 0
            start = time.perf_counter()
            execute(steps, RepeatedStep.next)
            if i >= WARMUP_STEPS:
                wall.append(time.perf_counter() - start)
                inside.append(timer.seconds)
        calls = timer.calls
        row = {"op": f"{point.mode} step", "rank": rank, "dp_rank": dp_rank, "batch_size": point.batch_size,
               "context_len": point.context_len, "new_tokens": new, "collective_calls": calls,
               "step_ms": statistics.median(wall) * 1e3, "in_collectives_ms": statistics.median(inside) * 1e3}
        if spec["profile"]:
            profiler = LayerKindProfiler(runner.model, config.model.device, timer)
            try:
                for _ in range(PROFILE_STEPS):
                    profiler.step(functools.partial(execute, steps), RepeatedStep.next)
            finally:
                profiler.remove()
            row["profile"] = profiler.shares()
        execute(steps, RepeatedStep.retire)
        rows.append(row)
    return rows


def _print(rows: list[dict], spec: dict) -> None:
    print(f"{spec['backend']}, {spec['world_size']} ranks, {spec['threads']} thread(s) each")
    print(f"{'op':<17} {'bytes':>10} {'median us':>10} {'mean us':>10} {'p90 us':>10} {'GB/s':>7}   (rank 0)")
    for r in rows:
        if "bytes" in r:
            print(f"{r['op']:<17} {r['bytes']:>10} {r['median_us']:>10.1f} {r['mean_us']:>10.1f} "
                  f"{r['p90_us']:>10.1f} {r['gb_s']:>7.3f}")
    steps = [r for r in rows if "step_ms" in r]
    if steps:
        print(f"\n{spec['model']}: {spec['steps']} steps per row, medians")
        print(f"{'step':<13} {'rank':>4} {'batch':>5} {'ctx':>6} {'new':>5} {'step ms':>9} {'in coll. ms':>11} "
              f"{'share':>6} {'calls':>6}")
        for r in sorted(steps, key=lambda r: (r["batch_size"], r["rank"])):
            print(f"{r['op']:<13} {r['rank']:>4} {r['batch_size']:>5} {r['context_len']:>6} {r['new_tokens']:>5} "
                  f"{r['step_ms']:>9.1f} {r['in_collectives_ms']:>11.1f} {r['in_collectives_ms'] / r['step_ms']:>6.0%} "
                  f"{r['collective_calls']:>6}")
            if "profile" in r:
                print("      profile: " + ", ".join(f"{k} {v:.0%}" for k, v in r["profile"].items()))


@register_subcommand("bench comm", "latency of all_reduce, all_gather, all_to_all and object broadcast between "
                     "local worker processes; with --model, the share of real TP or EP steps spent in them",
                     _add_comm_args)
def run_comm(args: argparse.Namespace) -> int:
    import torch.multiprocessing

    from rackserve.distributed.parallel_state import free_port
    try:
        ops = [op.strip() for op in args.ops.split(",") if op.strip()]
        spec = {"world_size": args.world_size, "backend": args.backend, "sizes": _sizes(args.sizes), "ops": ops,
                "iters": args.iters, "threads": args.threads or max(1, (os.cpu_count() or 1) // args.world_size),
                "model": args.model, "mode": args.mode, "context_len": args.context_len, "new_tokens": args.new_tokens,
                "steps": args.steps, "batch_sizes": [int(b) for b in args.batch_sizes.split(",") if b.strip()],
                "enable_expert_parallel": args.enable_expert_parallel, "data_parallel_size": args.data_parallel_size,
                "profile": args.profile}
        if args.world_size < 2 or args.iters < 1 or args.steps < 1 or not set(ops) <= set(OPS):
            raise ValueError(f"--world-size >= 2, --iters and --steps >= 1, --ops among {OPS}")
        if args.data_parallel_size < 1 or args.world_size % args.data_parallel_size:
            raise ValueError("--data-parallel-size must divide --world-size")
    except ValueError as e:
        print(f"rackserve bench comm: {e}", file=sys.stderr)
        return 2
    ctx = torch.multiprocessing.get_context("spawn")
    port = free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(args.world_size)]
    procs = [ctx.Process(target=_rank_main, args=(r, spec, port, pipes[r][1]), daemon=True)
             for r in range(args.world_size)]
    for p in procs:
        p.start()
    rows: list[dict] = []
    try:
        for rank, (receive, send) in enumerate(pipes):
            send.close()
            try:
                part = receive.recv()
            except EOFError:
                print(f"rackserve bench comm: rank {rank} died (see its traceback above)", file=sys.stderr)
                return 1
            rows += part if rank == 0 else [r for r in part if "step_ms" in r]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    _print(rows, spec)
    if args.output:
        from rackserve.bench.limits import processor_name
        result = {"command": "rackserve " + " ".join(sys.argv[1:]),
                  "machine": platform.processor() or platform.machine(),
                  "processor": processor_name("cuda" if args.backend == "nccl" else "cpu"), "cpu_count": os.cpu_count(),
                  "load_average": os.getloadavg(), **spec, "rows": rows}
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.output}")
    return 0
