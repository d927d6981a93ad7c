"""`rackserve bench pd-itl`: the decode-latency goal of prefill/decode disaggregation, measured on
its own. Decode lanes stream short-prompt completions back to back, straight to the instance that
decodes; its inter-token latency (ITL: the gaps between a stream's chunks after its first) is
measured once with only those lanes running ("decode-only") and once while long prompts arrive at
a fixed interval ("mixed"); bench/pd_itl_load.py runs a phase and says why the lanes bypass the
prefiller (the decoder gets the same decode load in both phases). The same two phases run, in the
same invocation, against 1 prefill + 1 decode instance, the long prompts behind `rackserve proxy`
("pd"), and against one colocated instance ("colocated"). The goal (issue 8): the decoder's P90 ITL
under mixed load within 1.5x of its decode-only P90 ITL. `--prefill-cpus`/`--decode-cpus` give
the prefiller and the decoder cores of their own (the CPU analog of their own devices); the
colocated instance then gets both sets. The proxy and the load generator are not bound.

This file starts and stops the instances it measures and measures only; it never serves.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile

from rackserve.bench.pd_itl_load import run_phase
from rackserve.bench.record import write_record
from rackserve.router.cluster import stop_instances, wait_healthy
from rackserve.serve.cli import register_subcommand

GOAL = 1.5


def _start(cmd: list[str], threads: int, log_dir: str, name: str) -> tuple[subprocess.Popen, str]:
    from rackserve.distributed.parallel_state import free_port
    port = free_port()
    log = open(os.path.join(log_dir, f"{name}.log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "rackserve.serve.cli", *cmd, "--port", str(port),
                             "--uvicorn-log-level", "warning"], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return proc, f"http://127.0.0.1:{port}"


def _wait_healthy(procs: list[subprocess.Popen], urls: list[str]) -> None:
    failure = wait_healthy(procs, urls)
    if failure:
        raise RuntimeError(failure)


def bind_flags(cpus: str | None) -> list[str]:
    return [] if not cpus else ["--cpu-omp-threads-bind", cpus]


def colocated_binding(args: argparse.Namespace) -> tuple[str | None, int]:
    """The colocated instance's CPUs and threads: with --prefill-cpus/--decode-cpus, both sets
    and a thread per CPU (the cores the P/D pair has between them); else unbound, --threads."""
    if not (args.prefill_cpus and args.decode_cpus):
        return None, args.threads
    from rackserve.executor.cpu_bind import format_cpu_list, parse_cpu_list
    cpus = tuple(sorted(set(parse_cpu_list(args.prefill_cpus)) | set(parse_cpu_list(args.decode_cpus))))
    return format_cpu_list(cpus), len(cpus)


def start_setup(setup: str, args: argparse.Namespace, log_dir: str) -> tuple[list[subprocess.Popen], str, str]:
    """The setup's processes (front last), the URL of the instance that decodes (the decode lanes
    go there, pd_itl_load.py says why) and the URL the long prompts go to."""
    engine = ["serve", "--model", args.model, "--max-model-len", str(args.max_model_len), *args.engine_args.split()]
    if setup == "colocated":
        cpus, threads = colocated_binding(args)
        proc, url = _start(engine + bind_flags(cpus), threads, log_dir, "colocated")
        _wait_healthy([proc], [url])
        return [proc], url, url
    procs, urls = [], []
    for role, name, cpus in (("kv_producer", "prefill", args.prefill_cpus), ("kv_consumer", "decode", args.decode_cpus)):
        config = {"kv_connector": "MooncakeConnector", "kv_role": role}
        proc, url = _start([*engine, "--kv-transfer-config", json.dumps(config), *bind_flags(cpus)], args.threads,
                           log_dir, name)
        procs.append(proc)
        urls.append(url)
    _wait_healthy(procs, urls)
    proxy, url = _start(["proxy", "--prefill", urls[0], "--decode", urls[1]], 1, log_dir, "proxy")
    procs.append(proxy)
    _wait_healthy([proxy], [url])
    return procs, urls[1], url


def run(args: argparse.Namespace) -> dict:
    from rackserve.bench.limits import measure_limits
    log_dir = tempfile.mkdtemp(prefix="rackserve-pd-itl-")
    rows = []
    for setup in args.setups.split(","):
        procs, lane_url, long_url = start_setup(setup, args, log_dir)
        try:
            import httpx
            model = httpx.get(lane_url + "/v1/models", timeout=10).json()["data"][0]["id"]
            rng = random.Random(args.seed)
            warm_up = argparse.Namespace(**{**vars(args), "duration": min(3.0, args.duration)})
            asyncio.run(run_phase(lane_url, long_url, model, warm_up, False, rng))
            for mixed in (False, True):
                row = {"setup": setup, **asyncio.run(run_phase(lane_url, long_url, model, args, mixed, rng))}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            stop_instances(procs[::-1])
    ratios = {}
    for setup in {r["setup"] for r in rows}:
        by = {r["phase"]: r for r in rows if r["setup"] == setup}
        ratios[setup] = by["mixed"]["itl_p90_ms"] / by["decode-only"]["itl_p90_ms"]
    return {"rows": rows, "p90_itl_mixed_over_decode_only": ratios, "goal": GOAL,
            "binding": {"prefill": args.prefill_cpus, "decode": args.decode_cpus,
                        "colocated": colocated_binding(args)[0], "threads": args.threads},
            "goal_met": {s: r <= GOAL for s, r in ratios.items()}, "logs": log_dir,
            "limits": measure_limits("cpu").__dict__}


def _add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the model every instance serves")
    parser.add_argument("--setups", default="pd,colocated", help="pd (1P+1D behind rackserve proxy), colocated")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per instance (OMP_NUM_THREADS)")
    parser.add_argument("--prefill-cpus", help="CPUs the prefiller is bound to (--cpu-omp-threads-bind), e.g. 0")
    parser.add_argument("--decode-cpus", help="CPUs the decoder is bound to, e.g. 1; with --prefill-cpus, the "
                        "colocated instance gets both sets and a thread per CPU")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--engine-args", default="", help="more flags for every instance, space-separated")
    parser.add_argument("--decode-lanes", type=int, default=2, help="streams decoding at once")
    parser.add_argument("--decode-prompt-tokens", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens per decode-lane request")
    parser.add_argument("--long-prompt-tokens", type=int, default=1024)
    parser.add_argument("--long-output-tokens", type=int, default=4)
    parser.add_argument("--long-interval", type=float, default=3.0, help="seconds between long prompts (mixed)")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per phase")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-token-id", type=int, default=40000,
                        help="prompt tokens are drawn from [100, this): below the model's vocabulary")
    parser.add_argument("--output", help="write the results as JSON here")


@register_subcommand("bench pd-itl", "decoder ITL with decodes only vs with long prompts arriving: P/D against "
                     "colocated (the disaggregation goal)", _add_args)
def _bench_pd_itl(args: argparse.Namespace) -> int:
    result = run(args)
    print(f"{'setup':>10} {'phase':>12} {'ITL P50 ms':>10} {'ITL P90 ms':>10} {'ITLs':>6} {'lanes':>6} "
          f"{'running':>7} {'long':>5}")
    for r in result["rows"]:   # lanes: streams decoding at once; running: the decoder's mean batch
        print(f"{r['setup']:>10} {r['phase']:>12} {r['itl_p50_ms']:>10.1f} {r['itl_p90_ms']:>10.1f} "
              f"{r['itl_count']:>6} {r['lane_concurrency']:>6.2f} {r['decoder_running_mean']:>7.2f} "
              f"{r['long_prompts']:>5}")
    for setup, ratio in result["p90_itl_mixed_over_decode_only"].items():
        print(f"{setup}: P90 ITL mixed / decode-only = {ratio:.2f} (goal <= {GOAL}: "
              f"{'met' if ratio <= GOAL else 'not met'})")
    if args.output:
        write_record(args.output, result)
    return 0
