"""What a simulated DEP group's ranks wait for: each DP step's idle time split by cause.

A rank's idle time in a lockstep step is the slowest rank's busy time minus its own
(engine/data_parallel.py), and a rank's busy time is its dense, attention and MoE seconds
(sim/cost.py). This script runs `rackserve sim` with the cost model's step wrapped to keep every
step's per-rank parts, and splits the idle of the steady window (the steps started while lanes
started measured requests, as `dp_idle_share_steady`) into the slowest rank's lead in dense work
(tokens: a rank short of a full chunk budget), in attention + indexer (chunks at a deeper
context) and in MoE (the experts each rank holds); and by the kind of step it came in: a rank
with nothing scheduled, prompt chunks on some ranks only, on every rank, or decodes only (the
ranks' decode counts equal or not), which says what a DP-rank choice could even out (a router can
fill an empty rank or even out decode counts, but a prompt arriving on one rank is a chunk only
that rank computes). Under P/D the prefill and decode groups' steady idle is also given apart, by
DP size (`steady_by_dp_size`). It changes nothing it measures.

  python bench/sim_dp_idle.py --output bench/results/sim-dp-idle-r7.json -- <rackserve sim flags>
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

from rackserve.cpu_dtype import cpu_identity
from rackserve.serve.cli import main as cli_main
from rackserve.sim import cost

STEPS: list[dict] = []


def _record(step):
    def wrapped(self, batches):
        result = step(self, batches)
        if len(result.ranks) > 1 and any(batches):
            STEPS.append({"start": asyncio.get_running_loop().time(), "ranks": len(result.ranks),
                          "tokens": [sum(w.new_tokens for w in b) for b in batches],
                          "context": [max((w.context for w in b), default=0) for b in batches],
                          "dense": [r.dense.seconds for r in result.ranks],
                          "attention": [r.attention.seconds for r in result.ranks],
                          "moe": [r.moe.seconds for r in result.ranks],
                          "kinds": [rank_kind(b) for b in batches],
                          "decodes": [len(b) for b in batches]})
        return result
    return wrapped


def rank_kind(batch) -> str:
    """"empty" (nothing scheduled), "prefill" (a prompt chunk among its sequences) or "decode"."""
    if not batch:
        return "empty"
    return "prefill" if any(not w.samples or w.new_tokens > w.drafts + 1 for w in batch) else "decode"


def step_kind(kinds: list[str], decodes: list[int]) -> str:
    """One of STEP_KINDS from the ranks' kinds and their sequence counts."""
    if "empty" in kinds:
        return "a_rank_empty"
    if "prefill" in kinds:
        return "prefill_on_every_rank" if all(k == "prefill" for k in kinds) else "prefill_on_some_ranks"
    return "decode_only_same_count" if len(set(decodes)) == 1 else "decode_only_counts_differ"


STEP_KINDS = ("a_rank_empty", "prefill_on_some_ranks", "prefill_on_every_rank", "decode_only_counts_differ",
              "decode_only_same_count")


def split(steps: list[dict], budget: int) -> dict:
    """Idle seconds summed over ranks and steps, by what the slowest rank had more of and by the kind
    of step (`step_kind`)."""
    out = {"steps": len(steps), "busy": 0.0, "idle": 0.0, "idle_dense": 0.0, "idle_attention": 0.0,
           "idle_moe": 0.0, "idle_in_steps_with_a_rank_short_of_budget": 0.0, "steps_with_a_rank_short": 0,
           "idle_by_step_kind": dict.fromkeys(STEP_KINDS, 0.0), "steps_by_kind": dict.fromkeys(STEP_KINDS, 0)}
    for s in steps:
        busy = [d + a + m for d, a, m in zip(s["dense"], s["attention"], s["moe"])]
        slow = busy.index(max(busy))
        idle = sum(busy[slow] - b for b in busy)
        out["busy"] += sum(busy)
        out["idle"] += idle
        kind = step_kind(s["kinds"], s["decodes"])
        out["idle_by_step_kind"][kind] += idle
        out["steps_by_kind"][kind] += 1
        for part in ("dense", "attention", "moe"):
            out[f"idle_{part}"] += sum(s[part][slow] - x for x in s[part])
        if min(s["tokens"]) < budget:
            out["steps_with_a_rank_short"] += 1
            out["idle_in_steps_with_a_rank_short_of_budget"] += idle
    total = out["idle"] + out["busy"]
    out["idle_share"] = out["idle"] / total if total else 0.0
    for key in ("idle_dense", "idle_attention", "idle_moe", "idle_in_steps_with_a_rank_short_of_budget"):
        out[key + "_of_idle"] = out[key] / out["idle"] if out["idle"] else 0.0
    out["step_kind_of_idle"] = {k: v / out["idle"] if out["idle"] else 0.0 for k, v in out["idle_by_step_kind"].items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--budget", type=int, default=16384, help="the run's --max-num-batched-tokens")
    parser.add_argument("sim", nargs=argparse.REMAINDER, help="-- then rackserve sim's flags")
    args = parser.parse_args()
    sim_args = [a for a in args.sim if a != "--"]
    cost.CostModel.step = _record(cost.CostModel.step)
    run_json = args.output + ".run.json"
    start = time.time()
    assert cli_main(["sim", *sim_args, "--output", run_json]) == 0
    run = json.load(open(run_json))["runs"][0]
    os.remove(run_json)
    # The steady window's bounds, from the record of the run (as sim/instance.py takes them).
    starts = [r["start"] for r in run["requests"] if r["kind"] != "warmup"] or [0.0]
    steady = [s for s in STEPS if min(starts) <= s["start"] <= max(starts)]
    report = {"what": __doc__.splitlines()[0], "command": " ".join(sys.argv),
              "cpu": cpu_identity(), "wall_s": round(time.time() - start, 1), "sim": run["sim"],
              "summary": {k: v for k, v in run["summary"].items() if not isinstance(v, dict) or k == "ttft"},
              "whole_run": split(STEPS, args.budget),
              "steady": split(steady, args.budget)}
    # Under P/D the prefill and decode groups differ in size: their idle apart, by DP size.
    sizes = sorted({s["ranks"] for s in steady})
    if len(sizes) > 1:
        report["steady_by_dp_size"] = {n: split([s for s in steady if s["ranks"] == n], args.budget) for n in sizes}
    print(json.dumps({k: report[k] for k in ("sim", "whole_run", "steady", "steady_by_dp_size") if k in report},
                     indent=1))
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
