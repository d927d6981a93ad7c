"""Scheduling policies for P90 ITL under load, compared in `rackserve sim` (issue 12, tenth round).

Each policy runs the AgentX-like workload at c = 1, 2, 4 for several seeds on a calibration; the
requests of all seeds are pooled per level and the script prints the P90 ITL (and its ratio to
c = 1's), throughput (tokens / T summed over seeds) and TTFT P50 / P90. Policies:

  base                  the defaults (decode first, 512-token budget, no cap)
  lpt=N, mnbt=N         --long-prefill-token-threshold N, --max-num-batched-tokens N
  mwt=N                 --max-waiting-tokens N (prompt work waits up to N steps while requests decode)
  cap=N                 a counterfactual scheduler: at most N prompt tokens a step while requests decode
  free                  a counterfactual cost model: prompt tokens cost nothing (only decodes are priced),
                        so whatever ratio is left comes from decodes sharing steps with decodes

    python bench/sim_itl_policies.py "base mwt=32 cap=4 free" --seeds 0,1,2,3 --duration 120 \
        --hardware rackserve/sim/calibration/cpu-smollm2-gguf-zen3.json --output RESULT.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from rackserve.core.scheduler import Scheduler
from rackserve.cpu_dtype import cpu_identity
from rackserve.sim import cli
from rackserve.sim.cost import CostModel

FLAGS = {"lpt": "--long-prefill-token-threshold", "mnbt": "--max-num-batched-tokens", "mwt": "--max-waiting-tokens"}


def _decodes_only(step):
    def priced(self, batches):
        return step(self, [[w for w in b if w.new_tokens == 1 and w.samples] for b in batches])
    return priced


def _capped(n: int):
    def allowance(self, num_decodes: int) -> int:
        return n if num_decodes else self.max_num_batched_tokens
    return allowance


def run(policy: str, seed: int, levels: list[int], duration: float, hardware: str) -> dict:
    kind, _, value = policy.partition("=")
    flags = [FLAGS[kind], value] if kind in FLAGS else []
    allowance, step = Scheduler._prefill_allowance, CostModel.step
    try:
        if kind == "cap":
            Scheduler._prefill_allowance = _capped(int(value))
        elif kind == "free":
            CostModel.step = _decodes_only(step)
        elif kind not in FLAGS and kind != "base":
            raise ValueError(f"unknown policy {policy!r}")
        parser = argparse.ArgumentParser()
        cli.add_args(parser)
        args = parser.parse_args(["--hardware", hardware, "--workload", "agentx", "--seed", str(seed),
                                  "--duration", str(duration), "--max-model-len", "8192"] + flags)
        result = cli.simulate(args, levels)
    finally:
        Scheduler._prefill_allowance, CostModel.step = allowance, step
    out = {}
    for r in result["runs"]:
        s = r["summary"]
        done = [q for q in r["requests"] if q["kind"] != "warmup" and q["error"] is None
                and q["first_chunk"] is not None]
        out[s["concurrency"]] = {
            "itl": [(q["end"] - q["first_chunk"]) / (q["output_tokens"] - 1) for q in done if q["output_tokens"] >= 2],
            "ttft": [q["first_chunk"] - q["start"] for q in done],
            "tokens": s["input_tokens"] + s["output_tokens"], "seconds": s["duration"]}
    return out


def pooled(runs: list[dict], levels: list[int]) -> dict:
    table = {}
    for c in levels:
        itl = sum((r[c]["itl"] for r in runs), [])
        ttft = sum((r[c]["ttft"] for r in runs), [])
        table[c] = {"itl_p90_ms": float(np.percentile(itl, 90)) * 1e3,
                    "throughput": sum(r[c]["tokens"] for r in runs) / sum(r[c]["seconds"] for r in runs),
                    "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p90_s": float(np.percentile(ttft, 90)),
                    "requests": len(itl)}
    for c in levels:
        table[c]["itl_p90_ratio"] = table[c]["itl_p90_ms"] / table[levels[0]]["itl_p90_ms"]
    return table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("policies", help="space-separated policies (see the module's doc)")
    ap.add_argument("--seeds", default="0,1,2,3")
    ap.add_argument("--duration", type=float, default=120.0, help="virtual seconds a level")
    ap.add_argument("--levels", default="1,2,4", help="concurrency levels; the first is the ratios' base")
    ap.add_argument("--hardware", default="rackserve/sim/calibration/cpu-smollm2-gguf-zen3.json")
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    levels, seeds = [int(x) for x in a.levels.split(",")], [int(x) for x in a.seeds.split(",")]
    results = {"command": sys.argv, "cpu": cpu_identity(), "hardware": a.hardware, "seeds": seeds,
               "duration": a.duration, "policies": {}}
    for policy in a.policies.split():
        t = time.time()
        table = pooled([run(policy, seed, levels, a.duration, a.hardware) for seed in seeds], levels)
        results["policies"][policy] = table
        print(f"{policy:10s} ({time.time() - t:.0f} s)", " | ".join(
            f"c{c}: P90 ITL {v['itl_p90_ms']:.1f} ms x{v['itl_p90_ratio']:.2f}, {v['throughput']:.0f} tok/s, "
            f"TTFT P50/P90 {v['ttft_p50_s']:.2f}/{v['ttft_p90_s']:.2f} s" for c, v in table.items()), flush=True)
    if a.output:
        with open(a.output, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
