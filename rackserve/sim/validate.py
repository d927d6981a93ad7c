"""Simulated against measured: for each concurrency level present in both a `bench serve` result
and a `rackserve sim` result, the error of throughput per device and of P90 interactivity (and of
TTFT P50 and hit rate, for the record). `python -m rackserve.sim.validate MEASURED SIMULATED
[--output FILE]` prints the table and writes it as JSON, with the machine each side ran on (CPU with
its family and model, load average: `machine`) and the calibration that priced the simulation: an
error means little without the processor and the load the measurement had.

This file owns the comparison only; it must never run a benchmark or a simulation.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

COMPARED = (("throughput_per_device", "tok/s/dev"), ("interactivity_p90", "P90 tok/s/user"))


def _error(sim: float | None, measured: float | None) -> float | None:
    if sim is None or measured is None or measured == 0:
        return None
    return sim / measured - 1


def compare(measured: dict, simulated: dict) -> list[dict]:
    sims = {r["concurrency"]: r["summary"] for r in simulated["runs"]}
    rows = []
    for run in measured["runs"]:
        c, m = run["concurrency"], run["summary"]
        s = sims.get(c)
        if s is None:
            continue
        row = {"concurrency": c}
        for key, _ in COMPARED:
            row[key] = {"measured": m[key], "simulated": s[key], "error": _error(s[key], m[key])}
        row["ttft_p50"] = {"measured": m["ttft"]["p50"], "simulated": s["ttft"]["p50"],
                           "error": _error(s["ttft"]["p50"], m["ttft"]["p50"])}
        row["hit_rate"] = {"measured": m["hit_rate"], "simulated": s["hit_rate"]}
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="error of a simulated bench serve result against a measured one")
    parser.add_argument("measured")
    parser.add_argument("simulated")
    parser.add_argument("--output", default=None)
    parser.add_argument("--goal", type=float, default=0.15, help="largest error counted as a match (0.15: 15%%)")
    args = parser.parse_args(argv)
    with open(args.measured) as f, open(args.simulated) as g:
        measured, simulated = json.load(f), json.load(g)
    rows = compare(measured, simulated)
    machines = {"measured": measured.get("machine"), "simulated": simulated.get("machine")}
    calibration = (simulated.get("sim") or {}).get("calibration")
    m = machines["measured"] or {}
    print(f"measured on {m.get('cpu', 'an unrecorded CPU')} x{m.get('cpu_count', '?')}, load average at its end "
          f"{'/'.join(f'{x:.2f}' for x in m.get('load_average', [])) or 'unrecorded'}; "
          f"simulated with {calibration or (simulated.get('sim') or {}).get('hardware', 'an unrecorded device')}")
    for r in rows:
        r["within_goal"] = all(r[k]["error"] is not None and abs(r[k]["error"]) <= args.goal for k, _ in COMPARED)
    print(f"{'c':>3}  {'tok/s/dev meas':>14} {'sim':>8} {'err':>6}   {'P90 tok/s/user meas':>19} {'sim':>6} {'err':>6}"
          f"   {'TTFT P50 meas':>13} {'sim':>6}   hit meas/sim   within {args.goal:.0%}")
    for r in rows:
        t, i, f_, h = r["throughput_per_device"], r["interactivity_p90"], r["ttft_p50"], r["hit_rate"]
        print(f"{r['concurrency']:>3}  {t['measured']:>14.1f} {t['simulated']:>8.1f} {t['error']:>+6.0%}   "
              f"{i['measured']:>19.2f} {i['simulated']:>6.2f} {i['error']:>+6.0%}   {f_['measured']:>13.3f} "
              f"{f_['simulated']:>6.3f}   {h['measured'] or 0:.2f}/{h['simulated'] or 0:.2f}"
              f"      {'yes' if r['within_goal'] else 'no'}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"measured": args.measured, "simulated": args.simulated, "goal": args.goal,
                       "simulated_command": simulated.get("command"), "machine": machines,
                       "calibration": calibration, "rows": rows}, f, indent=1)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
