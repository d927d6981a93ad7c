"""`rackserve bench router`: what the router's policies buy, and what the router costs.

1. Policies: starts N instances once (the threads split among them), then for each policy a
   `rackserve router` in front of them and one `rackserve bench serve` run through it (AgentX-like
   by default; run prompts carry a fresh nonce, so no run hits another's cache): hit rate, TTFT
   P50/P90, throughput per device and P90 interactivity per policy, with kv's ratio to each.
2. Overhead: decisions per second of the routing path alone (tokenize, hash, index lookup, cost)
   on an index filled to a realistic size; and the latency the router adds per request against
   calling an instance directly, measured in the same run, interleaved.

This file owns the orchestration and the JSON; it never computes serving metrics (bench serve).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from rackserve.config import EngineArgs
from rackserve.router.cluster import wait_healthy
from rackserve.serve.cli import register_subcommand

POLICIES = "kv,round_robin,least_load,prefix"


def _add_args(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads split among the instances")
    parser.add_argument("--policies", default=POLICIES, help="comma-separated, one bench serve run each")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--bench-args", default="", help="more `bench serve` flags, as one string")
    parser.add_argument("--latency-requests", type=int, default=60, help="pairs of requests, router vs direct")
    parser.add_argument("--index-blocks", type=int, default=200_000, help="blocks in the index, overhead part")
    parser.add_argument("--output", default=None, help="write the results JSON here")
    parser.add_argument("--health-interval", type=float, default=1.0)
    parser.add_argument("--overlap-weight", default="measured",
                        help="kv policy's overlap weight (measured: priced in learned seconds, the router's "
                             "default); comma-separated for one kv run per weight (kv@W)")
    parser.add_argument("--router-args", default="", help="more `rackserve router` flags, as one string")


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rackserve.serve.cli", *args]


def _router(urls: list[str], interval: float, *flags: str) -> tuple[subprocess.Popen, str]:
    from rackserve.distributed.parallel_state import free_port
    port = free_port()
    proc = subprocess.Popen(_cli("router", "--port", str(port), "--health-interval", str(interval), *flags, *[a for u in urls for a in ("--worker", u)]))
    url = f"http://127.0.0.1:{port}"
    failure = wait_healthy([proc], [url])
    if failure:
        proc.kill()
        raise RuntimeError(f"the router at {url}: {failure}")
    return proc, url


def _routed(url: str) -> dict[str, dict[str, float]]:
    """Per instance: requests, prompt tokens, predicted and actual cached tokens, the most any
worker had cached for the requests routed there, and requests moved off their cache (router
/metrics)."""
    out: dict[str, dict[str, float]] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        for name in ("requests", "prompt_tokens", "predicted_cached_tokens", "actual_cached_tokens",
                     "best_cached_tokens", "moved_off_cache"):
            if line.startswith(f"rackserve_router:{name}_total{{"):
                instance = line.split('instance="')[1].split('"')[0]
                per = out.setdefault(instance, {})
                per[name] = per.get(name, 0) + float(line.rsplit(" ", 1)[1])
    return out


def policy_runs(policies: str, overlap_weights: str) -> list[tuple[str, list[str]]]:
    """(label, router flags) per run: each policy once, kv once per overlap weight (kv@W when
    there are several; `measured` passes no weight: the router's learned prices)."""
    weights = overlap_weights.split(",")
    runs = []
    for policy in policies.split(","):
        if policy != "kv":
            runs.append((policy, ["--policy", policy]))
            continue
        for w in weights:
            weight = [] if w == "measured" else ["--overlap-weight", w]
            runs.append((f"kv@{w}" if len(weights) > 1 else "kv", ["--policy", "kv", *weight]))
    return runs


def run_policies(args: argparse.Namespace, urls: list[str], tokenizer: str) -> list[dict]:
    runs = []
    for label, flags in policy_runs(args.policies, args.overlap_weight):
        proc, url = _router(urls, args.health_interval, *flags, *args.router_args.split())
        try:
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                cmd = _cli("bench", "serve", "--base-url", url, "--concurrency", str(args.concurrency),
                           "--duration", str(args.duration), "--devices", str(args.instances), "--tokenizer",
                           tokenizer, "--no-progress", "--label", label, "--output", out.name,
                           *args.bench_args.split())
                subprocess.run(cmd, check=False)
                summary = json.loads(Path(out.name).read_text())["runs"][0]["summary"]
            runs.append({"policy": label, "router_flags": flags, "summary": summary, "routed": _routed(url),
                         "pool": httpx.get(f"{url}/router").json()})   # with each worker's learned price
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return runs


def routing_overhead(tokenizer_path: str, block_size: int, index_blocks: int, workers: int = 8) -> dict:
    """Decisions/s of tokenize + hash + index lookup + kv cost, on an index of `index_blocks`
    blocks spread over `workers` workers; prompts of ~2,000 tokens sharing prefixes with it."""
    from rackserve.core.hashing import block_hashes
    from rackserve.core.kv_events import BlockStored
    from rackserve.engine.tokenizer import load_tokenizer
    from rackserve.router.index import KVIndex, WorkerKey
    from rackserve.router.load import ActiveLoads
    from rackserve.router.policies import create_policy
    tokenizer = load_tokenizer(tokenizer_path)
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while caches keep keys and values".split()
    texts = [" ".join(rng.choice(words) for _ in range(1500)) for _ in range(64)]
    index, keys = KVIndex(), [WorkerKey(f"http://w{i}", 0) for i in range(workers)]
    filled = 0
    while filled < index_blocks:   # chains of 128 blocks, like long agentic contexts
        hashes = [rng.getrandbits(64) for _ in range(128)]
        index.apply(rng.choice(keys), BlockStored(hashes, None, [], block_size))
        filled += len(hashes)
    for text in texts:   # the prompts' own prefixes cached somewhere
        ids = tokenizer.encode(text)
        index.apply(rng.choice(keys), BlockStored(block_hashes(ids, block_size)[:40], None, [], block_size))
    policy, loads = create_policy("kv", seed=0), ActiveLoads()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < 3.0:
        ids = tokenizer.encode(texts[n % len(texts)])
        policy.choose(block_hashes(ids, block_size), keys, index, loads)
        n += 1
    seconds = time.perf_counter() - start
    # The same without tokenizing: what the router does once a prompt is token ids.
    ids_list = [tokenizer.encode(t) for t in texts]
    m, start = 0, time.perf_counter()
    while time.perf_counter() - start < 3.0:
        policy.choose(block_hashes(ids_list[m % len(ids_list)], block_size), keys, index, loads)
        m += 1
    return {"index_blocks": index.num_blocks(), "workers": workers, "prompt_tokens": len(ids_list[0]),
            "decisions_per_s": n / seconds, "decisions_per_s_without_tokenize": m / (time.perf_counter() - start)}


def added_latency(direct: str, router: str, model: str, n: int) -> dict:
    """The router's cost per request: pairs of the same kind of 1-token completion, one direct and
    one through the router, back to back (which goes first alternates, so drift cancels); the
    median and quartiles of the pairs' differences, and each side's median."""
    times: dict[str, list[float]] = {"direct": [], "router": []}
    with httpx.Client(timeout=60) as http:
        for i in range(n):
            sides = [("direct", direct), ("router", router)]
            for side, url in sides if i % 2 else sides[::-1]:
                body = {"model": model, "prompt": f"{side} {i} {random.random()} hello", "max_tokens": 1}
                start = time.perf_counter()
                http.post(f"{url}/v1/completions", json=body).raise_for_status()
                times[side].append(time.perf_counter() - start)
    diffs = sorted(r - d for r, d in zip(times["router"], times["direct"]))
    q1, median, q3 = statistics.quantiles(diffs, n=4, method="inclusive")
    return {"pairs": n, "direct_median_s": statistics.median(times["direct"]),
            "router_median_s": statistics.median(times["router"]), "added_median_s": median,
            "added_q1_s": q1, "added_q3_s": q3}


@register_subcommand("bench router", "routing policies compared through the router, and the router's cost",
                     _add_args)
def run(args: argparse.Namespace) -> int:
    from rackserve.bench.limits import processor_name
    from rackserve.router.cluster import start_instances, stop_instances, stop_on_sigterm
    from rackserve.router import BOTH
    stop_on_sigterm()
    procs, urls = start_instances(args, [BOTH] * args.instances)
    try:
        failure = wait_healthy(procs, urls)
        if failure:
            print(f"rackserve bench router: {failure}", file=sys.stderr)
            return 1
        info = httpx.get(f"{urls[0]}/kv_events").json()
        model = info["served_model_name"]
        runs = run_policies(args, urls, info["tokenizer"])
        proc, router_url = _router(urls, args.health_interval, "--policy", "kv", *args.router_args.split())
        try:
            latency = added_latency(urls[0], router_url, model, args.latency_requests)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        overhead = routing_overhead(info["tokenizer"], info["block_size"], args.index_blocks)
    finally:
        stop_instances(procs)
    result = {"command": sys.argv, "cpu": processor_name(), "instances": args.instances, "threads": args.threads,
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "policies": runs, "latency": latency,
              "overhead": overhead}
    _print(result)
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.output}")
    return 0


def _print(result: dict) -> None:
    base = next((r["summary"] for r in result["policies"] if r["policy"].startswith("kv")), None)
    print(f"{'policy':<12} {'hit rate':>9} {'TTFT P50':>9} {'TTFT P90':>9} {'tok/s/dev':>10} {'P90 tok/s/user':>15}  first kv's ratio (TTFT P90, tput)")
    for run in result["policies"]:
        s = run["summary"]
        ratio = ""
        if base is not None and s["ttft"]["p90"] and s["throughput_per_device"]:
            ratio = f"{s['ttft']['p90'] / base['ttft']['p90']:.2f}x, {base['throughput_per_device'] / s['throughput_per_device']:.2f}x"
        hit = s["hit_rate"] if s["hit_rate"] is not None else s["request_hit_rate"]
        print(f"{run['policy']:<12} {hit or 0:>9.1%} {s['ttft']['p50'] * 1e3:>7.0f}ms {s['ttft']['p90'] * 1e3:>7.0f}ms "
              f"{s['throughput_per_device']:>10.1f} {s['interactivity_p90']:>15.1f}  {ratio}")
    lat, over = result["latency"], result["overhead"]
    print(f"router adds {lat['added_median_s'] * 1e3:.1f} ms per request (median of {lat['pairs']} pairs; quartiles "
          f"{lat['added_q1_s'] * 1e3:.1f}..{lat['added_q3_s'] * 1e3:.1f} ms; medians {lat['router_median_s'] * 1e3:.1f} "
          f"through the router, {lat['direct_median_s'] * 1e3:.1f} direct)")
    print(f"routing path: {over['decisions_per_s']:.0f} decisions/s with tokenizing, "
          f"{over['decisions_per_s_without_tokenize']:.0f} without ({over['prompt_tokens']}-token prompts, "
          f"{over['index_blocks']} blocks over {over['workers']} workers)")
