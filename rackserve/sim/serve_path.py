"""The serving path's cost on a machine where it shares the cores with the model's steps (a CPU),
measured from a `bench serve` run of the random workload.

`bench forward` times the execute path alone. A server also runs, each step, the scheduler's
bookkeeping, the output processor and the detokenizer (engine thread), and per streamed token an
SSE chunk through the event loop and the HTTP stack, while the benchmark client parses it; on two
cores all of that competes with the model's threads (and the GIL with the engine thread). Under
closed-loop lanes with no think time (the random workload), c lanes keep c sequences decoding, so
the median gap between two streamed chunks at concurrency c is a decode step of c sequences (the
median, not the ITL: a request's mean ITL also carries the steps other requests' prompt chunks
lengthen, which the simulation schedules itself). It is fitted as
d x (the cost model's step for that batch: c sequences after the prompt and half the output) + a
by least squares over the levels: `serve_decode_slowdown` d (how a served step of decodes compares
with bench forward's, the cores shared with the serving threads as decoding shares them) and
`serve_step_overhead` a (the engine's own bookkeeping a step: scheduler, output processor,
detokenizer). The first level's TTFT (one request at a time: its prompt's chunks, nothing streaming)
gives `serve_slowdown`, the factor of steps with a prompt chunk: TTFT = the front path (measured
apart, bench/front_path.py, passed in) + slowdown x (the prompt's chunks) + a a chunk. A per-sequence
term is not fitted: over closed-loop levels the decode step grows with c as c does, so it and d
cannot be told apart. At one lane every gap is one decode step of one sequence of about the same
context (random: 1,024 + 128 tokens), so the gaps say how a served step's time spreads around what
its shape costs (the host's other tenants, the cores shared with the serving threads; a traced run
put none of it in the garbage collector or in the handoff to the client), in two parts: from step to
step (`serve_step_spread`: the gaps over their request's median), and from request to request
(`serve_slow_spread`: each request's median over the median request's), which holds for as long as
a request decoded (`serve_slow_seconds`): another tenant's burst slows a reply whole. This file owns
that measurement; it never runs anything.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics

from rackserve.sim.cost import CostModel, SeqWork
from rackserve.sim.hardware import Hardware
from rackserve.sim.model_spec import ModelSpec

SPREAD_QUANTILES = 20   # one per twentieth of the steps: enough for a P90 of a few requests' steps
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
            "context": prompt + output / 2, "prompt_tokens": prompt, "ttft_p50_s": s["ttft"]["p50"],
            "model_prefill_s": prefill, "prefill_steps": len(chunks)}


def step_spread(run: dict, quantiles: int = SPREAD_QUANTILES) -> dict:
    """A one-lane level's spread of decode steps: "step", the gaps over their request's median (the
    midpoint quantile of each of `quantiles` equal shares); "slow", each request's median gap over the
    median of those, sorted; "slow_seconds", how long a request decoded, on average."""
    if run["concurrency"] != 1:
        raise ValueError("the step spread is measured at one lane (every gap one decode step)")
    per_request = [[b - a for a, b in zip(r["chunk_times"], r["chunk_times"][1:])] for r in run["requests"]
                   if r["kind"] != "warmup" and r.get("error") is None and len(r["chunk_times"]) > 2]
    gaps = sorted(g / statistics.median(own) for own in per_request for g in own)
    if len(gaps) < quantiles or len(per_request) < 2:
        raise ValueError(f"{len(gaps)} chunk gaps in {len(per_request)} requests at one lane: too few to "
                         "measure the step spread")
    medians = [statistics.median(own) for own in per_request]
    middle = statistics.median(medians)
    return {"step": [gaps[int((i + 0.5) / quantiles * len(gaps))] for i in range(quantiles)],
            "slow": sorted(m / middle for m in medians),
            "slow_seconds": statistics.mean(sum(own) for own in per_request)}


def _fit(points: list[dict]) -> tuple[float, float]:
    """(d, a), a >= 0, minimising the relative errors sum ((gap - d x step - a) / gap)^2 over the
    levels (as calibrate.py fits step times on log time: one level of long steps must not outweigh
    the others)."""
    xs, ys = [p["model_step_s"] for p in points], [p["median_chunk_gap_s"] for p in points]
    ws = [1 / y ** 2 for y in ys]
    if len(set(xs)) < 2:
        return ys[0] / xs[0], 0.0
    total = sum(ws)
    mx, my = sum(w * x for w, x in zip(ws, xs)) / total, sum(w * y for w, y in zip(ws, ys)) / total
    d = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    if my - d * mx < 0:     # through the origin
        return sum(w * x * y for w, x, y in zip(ws, xs, ys)) / sum(w * x * x for w, x in zip(ws, xs)), 0.0
    return d, my - d * mx


def measure_serve_path(result: dict, spec: ModelSpec, hw: Hardware, front: tuple[float, float] = (0.0, 0.0)) -> dict:
    """The serving path's cost from a bench serve result of the random workload (its levels' median
    chunk gap against the cost model's decode step on `hw`, and the first level's TTFT less the
    front path `front`: seconds a request, seconds a prompt token)."""
    if result.get("workload") != "random":
        raise ValueError("the serving path is measured on the random workload (lanes without think time keep "
                         f"a known batch); got {result.get('workload')!r}")
    model = CostModel(spec, hw)
    points = [_level(run, model) for run in result["runs"]]
    decode_slowdown, a = _fit(points)
    first = min(points, key=lambda p: p["concurrency"])
    slowdown = None     # no level of one request at a time: no prefill alone to measure
    spread: dict = {"step": [], "slow": [], "slow_seconds": 0.0}
    if first["concurrency"] == 1:
        spread = step_spread(min(result["runs"], key=lambda r: r["concurrency"]))
        front_s = front[0] + front[1] * first["prompt_tokens"]
        slowdown = (first["ttft_p50_s"] - front_s - first["prefill_steps"] * a) / first["model_prefill_s"]
    for p in points:
        p["fitted_gap_s"] = decode_slowdown * p["model_step_s"] + a
    return {"step_seconds": a, "decode_slowdown": decode_slowdown, "slowdown": slowdown, "spread": spread,
            "points": points,
            "front": list(front), "command": result.get("command"), "load": result.get("load_average")}


def with_serving_terms(hw: Hardware, spec: ModelSpec, serve_file: str | None,
                       front_file: str | None) -> tuple[Hardware, dict | None]:
    """`hw` with the front path of a bench/front_path.py result and the serving path of a bench
    serve run of the random workload (each optional), and the serving path's record."""
    front = (0.0, 0.0)
    if front_file:
        with open(front_file) as f:
            measured = json.load(f)
        front = (measured["request_seconds"], measured["prompt_token_seconds"])
        hw = dataclasses.replace(hw, serve_request_overhead=front[0], serve_prompt_token_overhead=front[1])
        print(f"front path: {front[0] * 1e3:.2f} ms a request + {front[1] * 1e6:.2f} us a prompt token")
    if not serve_file:
        return hw, None
    with open(serve_file) as f:
        serve = measure_serve_path(json.load(f), spec, hw, front)
    serve["file"] = os.path.basename(serve_file)
    hw = dataclasses.replace(hw, serve_step_overhead=serve["step_seconds"], serve_seq_overhead=0.0,
                             serve_slowdown=serve["slowdown"] or 1.0, serve_decode_slowdown=serve["decode_slowdown"],
                             serve_step_spread=tuple(serve["spread"]["step"]),
                             serve_slow_spread=tuple(serve["spread"]["slow"]),
                             serve_slow_seconds=serve["spread"]["slow_seconds"])
    step, slow = serve["spread"]["step"] or [1.0], serve["spread"]["slow"] or [1.0]
    print(f"serving path: steps with a prompt chunk x {hw.serve_slowdown:.2f}, steps of decodes x "
          f"{serve['decode_slowdown']:.2f}, + {serve['step_seconds'] * 1e3:.2f} ms a step; a step over its request's "
          f"median {step[0]:.2f}-{step[-1]:.2f}, a request's median over the median request's {slow[0]:.2f}-"
          f"{slow[-1]:.2f}, held {serve['spread']['slow_seconds']:.2f} s")
    return hw, serve
