"""The serving path's cost on a machine where it shares the cores with the model's steps (a CPU),
measured from a `bench serve` run of the random workload.

`bench forward` times the execute path alone. A server also runs, each step, the scheduler's
bookkeeping, the output processor and the detokenizer (engine thread), and per streamed token an
SSE chunk through the event loop and the HTTP stack, while the benchmark client parses it; on two
cores all of that competes with the model's threads (and the GIL with the engine thread). Under
closed-loop lanes with no think time (the random workload), c lanes keep c sequences decoding, so
the median gap between two streamed chunks at concurrency c is a decode step of c sequences (the
median, not the ITL: a request's mean ITL also carries the steps other requests' prompt chunks
lengthen, which the simulation schedules itself). Its excess over the cost model's step for that
batch (c sequences after the prompt and half the output) is the serving path's, fitted as a + b x c
by least squares over the levels (both kept >= 0): `serve_step_overhead` and `serve_seq_overhead`
of the `cpu` device. The first level's TTFT (one request at a time: its prompt's chunks, nothing
streaming) gives `serve_slowdown`: a served step's model time over the cost model's (the server's
threads take cores from the model's while it computes; a step trace, in-process, measures the
model alone). The two are fitted together: gap = slowdown x step + a + b x c, and TTFT = slowdown x
(the prompt's chunks) + a a chunk. This file owns that measurement; it never runs anything.
"""
from __future__ import annotations

import statistics

from rackserve.sim.cost import CostModel, SeqWork
from rackserve.sim.hardware import Hardware
from rackserve.sim.model_spec import ModelSpec

CHUNK = 512         # rackserve serve's --max-num-batched-tokens default: a prompt's chunk at concurrency 1


def _level(run: dict, model: CostModel) -> dict:
    s = run["summary"]
    c = run["concurrency"]
    measured = [r for r in run["requests"] if r["kind"] != "warmup" and r.get("error") is None]
    if not measured:
        raise ValueError(f"concurrency {c}: no completed request to measure")
    prompt = statistics.mean(r["prompt_tokens"] for r in measured)
    output = statistics.mean(r["output_tokens"] for r in measured)
    gaps = [b - a for r in measured for a, b in zip(r["chunk_times"], r["chunk_times"][1:])]
    if not gaps:
        raise ValueError(f"concurrency {c}: no request streamed two chunks")
    gap = statistics.median(gaps)
    step = model.step([[SeqWork(1, int(prompt + output / 2), True)] * c]).seconds
    chunks = [SeqWork(min(CHUNK, int(prompt) - start), start, start + CHUNK >= prompt)
              for start in range(0, int(prompt), CHUNK)]
    prefill = sum(model.step([[w]]).seconds for w in chunks)
    return {"concurrency": c, "median_chunk_gap_s": gap, "itl_p50_s": s["itl"]["p50"], "model_step_s": step,
            "excess_s": gap - step, "context": prompt + output / 2, "ttft_p50_s": s["ttft"]["p50"],
            "model_prefill_s": prefill, "prefill_steps": len(chunks)}


def _fit(points: list[dict]) -> tuple[float, float]:
    """(a, b) >= 0 minimising sum (excess - a - b c)^2."""
    xs, ys = [p["concurrency"] for p in points], [p["excess_s"] for p in points]
    if len(set(xs)) < 2:
        return max(0.0, ys[0]), 0.0
    mx, my = statistics.mean(xs), statistics.mean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    if b < 0:
        return max(0.0, my), 0.0
    if a < 0:   # through the origin
        return 0.0, max(0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs))
    return a, b


def measure_serve_path(result: dict, spec: ModelSpec, hw: Hardware) -> dict:
    """The serving path's cost a step and a streamed sequence, from a bench serve result of the
    random workload (its levels' median chunk gap against the cost model's decode step on `hw`)."""
    if result.get("workload") != "random":
        raise ValueError("the serving path is measured on the random workload (lanes without think time keep "
                         f"a known batch); got {result.get('workload')!r}")
    model = CostModel(spec, hw)
    points = [_level(run, model) for run in result["runs"]]
    first = min(points, key=lambda p: p["concurrency"])
    slowdown, a, b = 1.0, 0.0, 0.0
    for _ in range(20):     # alternate: a, b given the slowdown; the slowdown given a (converges fast)
        for p in points:
            p["excess_s"] = p["median_chunk_gap_s"] - slowdown * p["model_step_s"]
        a, b = _fit(points)
        if first["concurrency"] != 1:
            break           # no level of one request at a time: no prefill alone to measure
        slowdown = max(1.0, (first["ttft_p50_s"] - first["prefill_steps"] * a) / first["model_prefill_s"])
    for p in points:
        p["fitted_excess_s"] = a + b * p["concurrency"]
    return {"step_seconds": a, "seq_seconds": b, "slowdown": slowdown, "points": points,
            "command": result.get("command"), "load": result.get("load_average")}
