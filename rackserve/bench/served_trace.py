"""A served process traced: `rackserve serve` with every garbage collection (its generation,
thread and pause), every engine step (LLMEngine.step's and EngineCore.step's wall time) and every
step's shape (each scheduled request's new tokens and cached context) recorded, written as JSON
when the server exits. It answers where a slow gap between two streamed chunks went: into the
step itself, a collector pause, or the handoff to the client (`summarize` against a bench serve
result of the same run).

    python -m rackserve.bench.served_trace --trace-output T.json [--no-gc-freeze] serve --port P ...

It wraps the engine's methods from outside (a diagnostic: the engine is unchanged) and owns no
metric of bench's; it must never run in a served process of its own accord.
"""
from __future__ import annotations

import atexit
import bisect
import gc
import json
import statistics
import sys
import threading
import time
from typing import Sequence

GC_PAUSE_S = 0.003     # a collection longer than this is listed one by one


def install(output: str, freeze: bool = True) -> None:
    """Record into `output` at exit; `freeze=False` stops the engine's gc.freeze (the A/B's before)."""
    from rackserve.core.scheduler import Scheduler
    from rackserve.engine.core import EngineCore
    from rackserve.engine.llm_engine import LLMEngine
    record: dict = {"gc": [], "steps": [], "core": [], "shapes": []}
    started: dict[int, float] = {}

    def on_gc(phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            started[threading.get_ident()] = now
        else:
            begin = started.pop(threading.get_ident(), now)
            record["gc"].append((begin, now - begin, info["generation"], threading.current_thread().name))
    gc.callbacks.append(on_gc)

    def timed(cls: type, name: str, key: str) -> None:
        inner = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            begin = time.perf_counter()
            out = inner(self, *args, **kwargs)
            record[key].append((begin, time.perf_counter() - begin))
            return out
        setattr(cls, name, wrapper)
    timed(LLMEngine, "step", "steps")
    timed(EngineCore, "step", "core")
    schedule = Scheduler.schedule

    def shaped(self):
        so = schedule(self)
        cached = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
        cached.update({c.req_id: c.num_computed_tokens for c in so.scheduled_cached_reqs})
        if so.num_scheduled_tokens:
            record["shapes"].append((time.perf_counter(), [(n, cached[r]) for r, n in so.num_scheduled_tokens.items()]))
        return so
    Scheduler.schedule = shaped
    if not freeze:
        gc.freeze = lambda: None

    def dump() -> None:
        begin = time.perf_counter()
        gc.collect()
        record.update(full_collection_s=time.perf_counter() - begin, tracked_objects=len(gc.get_objects()),
                      frozen_objects=gc.get_freeze_count(), gc_freeze=freeze)
        with open(output, "w") as f:
            json.dump(record, f)
    atexit.register(dump)


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(trace: dict) -> dict:
    """Collections and steps while steps ran (start-up's excluded), by generation and percentile."""
    steps = trace["steps"]
    first, last = steps[0][0], steps[-1][0] + steps[-1][1]
    during = [g for g in trace["gc"] if first <= g[0] <= last]
    starts = [s[0] for s in steps]
    inside = 0.0
    for begin, pause, *_ in during:
        i = bisect.bisect_right(starts, begin) - 1
        inside += pause if i >= 0 and begin < steps[i][0] + steps[i][1] else 0.0
    durations = [s[1] for s in steps]
    # One-sequence decode steps by cached context: how much of their spread their shape explains.
    core_starts = [c[0] for c in trace["core"]]
    bands: dict[str, list[float]] = {}
    for at, shape in trace["shapes"]:
        i = bisect.bisect_right(core_starts, at) - 1
        if i >= 0 and len(shape) == 1 and shape[0][0] == 1:
            low = min(shape[0][1] // 1024, 4) * 1024
            bands.setdefault(f"{low}-{low + 1023 if low < 4096 else 'up'}", []).append(trace["core"][i][1])
    return {"steps": len(steps), "step_ms": {f"p{int(q * 100)}": round(_pct(durations, q) * 1e3, 2) for q in (.5, .9, .99)},
            "gc_while_serving": {f"gen{g}": {"count": sum(1 for x in during if x[2] == g),
                                             "total_ms": round(sum(x[1] for x in during if x[2] == g) * 1e3, 1)}
                                 for g in (0, 1, 2)},
            "one_decode_steps_ms_by_context": {band: {"count": len(v), "p50": round(_pct(v, .5) * 1e3, 2),
                                                      "p90": round(_pct(v, .9) * 1e3, 2)} for band, v in sorted(bands.items())},
            "gc_inside_steps_ms": round(inside * 1e3, 1),
            "startup_full_collections_ms": [round(g[1] * 1e3, 1) for g in trace["gc"] if g[0] < first and g[2] == 2],
            "full_collection_at_exit_ms": round(trace["full_collection_s"] * 1e3, 1),
            "tracked_objects": trace["tracked_objects"], "frozen_objects": trace["frozen_objects"]}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--summarize"]:
        for path in argv[1:]:
            with open(path) as f:
                print(path, json.dumps(summarize(json.load(f)), indent=1))
        return 0
    if argv[:1] != ["--trace-output"] or len(argv) < 3:
        print("usage: served_trace --trace-output T.json [--no-gc-freeze] serve ...  |  --summarize T.json...",
              file=sys.stderr)
        return 2
    output, rest = argv[1], argv[2:]
    freeze = rest[:1] != ["--no-gc-freeze"]
    install(output, freeze)
    from rackserve.serve.cli import main as cli
    return cli(rest if freeze else rest[1:]) or 0


if __name__ == "__main__":
    raise SystemExit(main())
